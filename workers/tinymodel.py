"""A tiny random-weight Llama model written to a directory, for tests and demos without a model hub.

The model is real in every way that matters to the worker: a ``LlamaConfig`` (2 layers, 4 attention
heads over 2 key-value heads so grouped-query attention is exercised), safetensors weights and a
byte-level BPE tokenizer trained here on a small embedded corpus. It loads offline with
``AutoModelForCausalLM.from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)``. Its output
is gibberish, but deterministic: the same seed writes byte-identical weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

#: The tokenizer's special tokens, in id order (so pad is 0, bos 1, eos 2, unk 3).
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
VOCAB_SIZE = 640
CONTEXT_LENGTH = 512
#: Standard deviation of the random matrices: larger than a trained model's init so the logits of
#: a random model are well separated and greedy decoding does not hinge on rounding.
WEIGHT_STD = 0.1

_CORPUS = """\
A priority queue hands the most urgent job to the next free worker. High comes before normal,
normal before low, and inside one priority the first job submitted is the first job served.
ZooKeeper keeps the shared state: pending entries, claims, results and the line of idle workers.
Each worker watches only its predecessor in the line, so a new job wakes one session, not all.
A GPU worker loads the model weights once and keeps them resident in device memory. Every request
needs room for its key and value cache, which grows with the prompt and with each new token.
The worker admits a job only when a slot is free and the estimated memory of the job fits.
When a worker dies, its ephemeral claim vanishes and another worker runs the job again.
A stale worker can never write a result, because the completion is one multi that checks the
version of the entry it claimed. The quick brown fox jumps over the lazy dog. Pack my box with
five dozen liquor jugs. How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
The model reads the prompt, then writes one token at a time until it reaches the end of sequence
or the maximum number of new tokens. Greedy decoding picks the most likely token at every step;
sampling draws from the distribution, shaped by the temperature and the top p nucleus.
Numbers and symbols appear too: 0 1 2 3 4 5 6 7 8 9, 10, 42, 128, 256, 512, 1024, 4096, 65536.
(parentheses) [brackets] {braces} <angles> "quotes" 'apostrophes' - dashes, commas; colons: dots.
def run(jobs): return [outcome for job in jobs]  # code looks like this, with spaces and tabs.
Hello world! Hello, worker. Good morning, queue. Thank you for waiting; your job is running now.
"""


def write_tiny_model(directory: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny model, tokenizer and generation config into ``directory``; return its path.

    Deterministic: the same ``seed`` writes the same weights file, byte for byte.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = model_config(tokenizer)
    model = _random_model(config, seed)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    _generation_config(config).save_pretrained(path)
    for written in path.iterdir():  # readable by the worker's own user (a systemd service)
        if written.is_file():
            written.chmod(0o644)
    return path


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer on the embedded corpus (fast and deterministic)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    bos = SPECIAL_TOKENS[1]
    # Like Llama, every encoded text starts with the bos token.
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bpe.token_to_id(bos))]
    )
    pad, bos, eos, unk = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token=unk,
        model_max_length=CONTEXT_LENGTH,
    )


def model_config(tokenizer: PreTrainedTokenizerFast, **shape: Any) -> LlamaConfig:
    """The tiny model's Llama config for ``tokenizer``; ``shape`` overrides its sizes (a GPU
    check needs attention heads of 64 dimensions, which some kernels require)."""
    sizes: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": CONTEXT_LENGTH,
        **shape,
    }
    return LlamaConfig(
        vocab_size=len(tokenizer),
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **sizes,
    )


def _generation_config(config: LlamaConfig) -> GenerationConfig:
    return GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )


def _random_model(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """Build the model and overwrite every weight from a private generator seeded with ``seed``.

    A private generator keeps the result independent of transformers' own init and of the global
    torch RNG state.
    """
    model: Any = LlamaForCausalLM(config)
    model = model.to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * WEIGHT_STD)
    return model.eval()
