from zkqueue.cli.main import main

main()
