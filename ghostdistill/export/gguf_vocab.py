"""A Hugging Face byte-level BPE tokenizer (GPT-2 style: SmolLM2, Llama 3, Qwen2) as GGUF vocabulary metadata,
the way llama.cpp's `convert_hf_to_gguf.py` writes it (`TextModel._set_vocab_gpt2`, `get_vocab_base`):

- `tokenizer.ggml.model` = ``gpt2``; `tokens`: one string per id up to the model's `vocab_size` (ids the
  tokenizer lacks become ``[PAD<i>]``, type UNUSED); `token_type`: CONTROL for special added tokens, USER_DEFINED
  for other added tokens, NORMAL for the rest; `merges`: the BPE merges as ``"a b"``.
- `tokenizer.ggml.pre`: the pre-tokenizer llama.cpp must run before BPE. llama.cpp names it by a hash: the
  SHA-256 of the token ids of one fixed text (`CHECK_TEXT`, copied from the converter), looked up in a table
  (`PRE_TOKENIZERS`, a subset of the converter's). An unknown hash whose pre-tokenizer is a bare `ByteLevel`
  with GPT-2's regex (no normaliser) is ``gpt-2``, the same split; anything else is refused, since a wrong
  pre-tokenizer silently changes what the model sees.
- bos / eos / unk / pad ids, `add_bos_token` / `add_eos_token` as the tokenizer behaves (does encoding a text
  add them?), and the chat template.

A tokenizer this writer does not read (SentencePiece's: Gemma, Llama 2, Mistral v0.1, whose llama.cpp
vocabulary is ``llama`` with per-token scores that a Hugging Face tokenizer.json does not keep) can still be
written when the model itself came from a GGUF file: `copy_vocab` copies that file's ``tokenizer.*`` keys,
llama.cpp's own vocabulary of the same model (pruning keeps the vocabulary).
"""

from __future__ import annotations

import hashlib
import json

import gguf

# `chktxt` of convert_hf_to_gguf.py (conversion/base.py, `get_vocab_base_pre`).
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 "
    "3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на "
    "Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll make "
    "it, 'D you like some tea? We'Ve a'lL"
)

# sha256(str(tokenizer.encode(CHECK_TEXT))) -> llama.cpp's pre-tokenizer name (from the converter's table).
PRE_TOKENIZERS = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # HuggingFaceTB/SmolLM-135M
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Meta-Llama-3-8B
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # openai-community/gpt2
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen/Qwen1.5-7B
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3-Embedding-0.6B
}


def pre_tokenizer(tokenizer, spec: dict) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer (see the module docstring); `spec`: its tokenizer.json."""
    digest = hashlib.sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    if digest in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[digest]
    pre = spec.get("pre_tokenizer") or {}
    if spec.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    raise ValueError(
        f"unknown pre-tokenizer (check hash {digest}, pre_tokenizer {pre.get('type')!r}): ghostdistill's GGUF "
        f"writer knows {sorted(set(PRE_TOKENIZERS.values()))} and bare GPT-2 ByteLevel; convert the exported "
        "folder with llama.cpp's convert_hf_to_gguf.py"
    )


def vocab_entries(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """(tokens, token types) for ids 0 … vocab_size-1, as the converter's `get_vocab_base`."""
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise ValueError(f"the tokenizer has id {max(vocab.values())}, beyond the model's vocab_size {vocab_size}")
    reverse = {i: t for t, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            # llama.cpp expects CONTROL and USER_DEFINED tokens pre-normalised.
            if not decoder[i].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder[i].special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types


def _looks_special(token: str) -> bool:
    """The converter's `does_token_look_special`."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def adds(tokenizer, token_id: int | None) -> tuple[bool, bool]:
    """(at the start, at the end): whether encoding a text adds `token_id`, as the tokenizer behaves."""
    if token_id is None:
        return False, False
    ids = tokenizer("a").input_ids
    return bool(ids) and ids[0] == token_id, bool(ids) and ids[-1] == token_id


def add_vocab(writer: gguf.GGUFWriter, tokenizer, vocab_size: int) -> None:
    """Write the tokenizer's vocabulary metadata."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"{type(tokenizer).__name__} is not a fast (tokenizers) tokenizer: GGUF export reads byte-level BPE "
            "tokenizers only; convert with llama.cpp's convert_hf_to_gguf.py"
        )
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(
            f"tokenizer model {model.get('type')!r}: ghostdistill's GGUF writer reads BPE tokenizers only; convert "
            "the exported folder with llama.cpp's convert_hf_to_gguf.py"
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    pre = pre_tokenizer(tokenizer, spec)
    tokens, types = vocab_entries(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for kind in ("bos", "eos", "unk", "pad"):
        token_id = getattr(tokenizer, f"{kind}_token_id")
        if token_id is not None:
            getattr(writer, f"add_{kind}_token_id")(token_id)
    writer.add_add_bos_token(adds(tokenizer, tokenizer.bos_token_id)[0])
    # The converter writes add_eos only when the tokenizer config sets it; llama.cpp's default is false.
    if adds(tokenizer, tokenizer.eos_token_id)[1]:
        writer.add_add_eos_token(True)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        writer.add_chat_template(template)


def copy_vocab(writer: gguf.GGUFWriter, source, vocab_size: int) -> None:
    """Copy the ``tokenizer.*`` keys of the GGUF file `source` (the model's own)."""
    reader = gguf.GGUFReader(str(source))
    fields = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens.data) != vocab_size:
        raise ValueError(
            f"{source} has {0 if tokens is None else len(tokens.data)} tokens, the model {vocab_size}: its vocabulary "
            "is not this model's"
        )
    for key, field in fields.items():
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
