"""Small local Hugging Face tokenizers for tests (no hub): a `tokenizers` object saved with a chat
template and loaded back through common.tokenizer, as a checkpoint's tokenizer would be."""

from __future__ import annotations


def saved_hf_tokenizer(path, raw, template: str | None):
    """`raw` (a tokenizers.Tokenizer with "<s>" / "</s>") saved at `path` with `template`, loaded back."""
    from transformers import PreTrainedTokenizerFast

    from common.tokenizer import load_tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    tok.chat_template = template
    tok.save_pretrained(path)
    return load_tokenizer(str(path))
