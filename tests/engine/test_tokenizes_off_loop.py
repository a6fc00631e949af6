"""`tokenizes_off_loop`: the one rule the engine's client port and the HTTP front end share for which
prompts are tokenized on an executor thread."""

from asyncpp.engine.input_processor import MESSAGE_CHARS, OFF_LOOP_TOKENIZE_CHARS, tokenizes_off_loop


def test_texts_and_chat_contents_past_the_bound_go_off_the_loop():
    n = OFF_LOOP_TOKENIZE_CHARS
    assert not tokenizes_off_loop("x" * n) and tokenizes_off_loop("x" * (n + 1))
    half = {"role": "user", "content": "x" * (n // 2 - MESSAGE_CHARS)}  # with its message's own cost
    assert not tokenizes_off_loop([half, half])
    assert tokenizes_off_loop([half, half, {"role": "user", "content": "x"}])  # contents add up
    assert not tokenizes_off_loop([{"role": "user", "content": None}, {"role": "user"}])  # no text: nothing to count
    assert not tokenizes_off_loop(list(range(n + 1)))  # token ids need no tokenizing
    assert not tokenizes_off_loop(None)


def test_many_empty_messages_go_off_the_loop():
    """The chat template and the markup it writes cost by the message, whatever the contents."""
    num = OFF_LOOP_TOKENIZE_CHARS // MESSAGE_CHARS
    assert not tokenizes_off_loop([{"role": "user", "content": ""}] * num)
    assert tokenizes_off_loop([{"role": "user", "content": ""}] * (num + 1))
    assert tokenizes_off_loop([{"role": "user", "content": ""}] * 1_000_000)
