"""systemd's notify protocol (Type=notify): READY=1, STOPPING=1, WATCHDOG=1 on $NOTIFY_SOCKET.

A plain datagram to a unix socket, so there is no dependency on libsystemd. Without
NOTIFY_SOCKET (not under systemd) every call is a no-op.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        self.address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        usec = os.environ.get("WATCHDOG_USEC")
        #: Seconds between WATCHDOG=1 pings (half of WatchdogSec), or None when not asked for.
        self.watchdog_interval = int(usec) / 2e6 if usec and usec.isdigit() else None

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def notify(self, *fields: str) -> bool:
        if not self.address:
            return False
        target = self.address
        if target.startswith("@"):  # abstract namespace socket
            target = "\0" + target[1:]
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(target)
            sock.sendall("\n".join(fields).encode())
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", f"STATUS={status}") if status else self.notify("READY=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")
