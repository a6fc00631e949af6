"""`python -m tests.runtime.slow_tokenizer_launch`: the launcher with a tokenizer that takes
`SLOW_TOKENIZE_S` over any prompt the engine tokenizes off its loop (a huge one).

The hook makes the slow case happen on purpose, whatever the machine's speed:
a port that awaited the tokenizing before reading its next message would
leave health requests unanswered for that long. Everything else is the real
launcher.
"""

from __future__ import annotations

import sys
import time

from asyncpp.engine.input_processor import InputProcessor
from asyncpp.launch import main

SLOW_TOKENIZE_S = 3.0
_tokenize = InputProcessor.tokenize


def _slow_tokenize(self, prompt):
    time.sleep(SLOW_TOKENIZE_S)  # on the executor thread the engine runs it on
    return _tokenize(self, prompt)


if __name__ == "__main__":
    InputProcessor.tokenize = _slow_tokenize
    sys.exit(main())
