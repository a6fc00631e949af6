"""Tokenizers, chat templates and incremental detokenization.

`load_tokenizer(source, path_or_name, vocab_size)` builds a `Tokenizer` from a
GGUF file, an HF directory or the byte-level test vocabulary;
`IncrementalDetokenizer` turns streamed token ids into text deltas and finds
stop strings.
"""

from asyncpp.model_files import default_gguf_path
from asyncpp.tokenizer.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from asyncpp.tokenizer.loader import TOKENIZER_SOURCES, load_tokenizer
from asyncpp.tokenizer.tokenizer import Tokenizer

__all__ = [
    "DetokenizerDelta",
    "IncrementalDetokenizer",
    "TOKENIZER_SOURCES",
    "Tokenizer",
    "default_gguf_path",
    "load_tokenizer",
]
