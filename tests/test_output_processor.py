"""Detokenization and stop strings with the real SmolLM2 tokenizer: whatever the text and wherever
a stop string falls across token boundaries, the stream never emits a character it must take back,
never emits any part of the stop string, and adds up to the final text."""
from hypothesis import given, settings, strategies as st

from workbench import SamplingParams
from workbench.engine.output_processor import OutputProcessor
from workbench.engine.sequence import Sequence

PIECES = ["Hello", " world", ",", " the", " café", " 東京", " 🙂", "###", " END", "\n", " naïve",
          "ing", " 42", "Straße", " <|", "stop", "ST", "OP"]


def run_stream(tokenizer, token_ids, stop):
    processor = OutputProcessor(tokenizer, eos_token_ids={2}, max_model_len=10**6)
    seq = Sequence("r", None, [1], SamplingParams(max_tokens=10**4, stop=stop))
    emitted = ""
    for token in token_ids:
        processor.append_token(seq, token)
        stable = processor.stable_text_len(seq)
        assert seq.text[:len(emitted)] == emitted      # nothing emitted is ever taken back
        emitted = seq.text[:max(stable, len(emitted))]
        if seq.is_finished:
            break
    return seq, emitted


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), min_size=1, max_size=12),
       data=st.data())
def test_stream_never_emits_a_stop_string_or_takes_text_back(smollm2_llm, pieces, data):
    tokenizer = smollm2_llm.get_tokenizer()
    text = "".join(pieces)
    token_ids = tokenizer.encode(text)
    full = tokenizer.decode(token_ids, skip_special_tokens=True)
    start = data.draw(st.integers(0, len(full) - 1))
    stop = full[start:start + data.draw(st.integers(1, 6))]
    seq, emitted = run_stream(tokenizer, token_ids, [stop])
    assert seq.finish_reason == "stop" and seq.stop_reason == stop
    assert seq.text == full[:full.index(stop)]
    assert emitted == seq.text and stop not in emitted


def test_without_stop_strings_the_stream_is_the_whole_decoded_text(smollm2_llm):
    tokenizer = smollm2_llm.get_tokenizer()
    ids = tokenizer.encode("Emoji 🙂 and 東京 split across byte-level tokens")
    seq, emitted = run_stream(tokenizer, ids, None)
    assert not seq.is_finished
    assert emitted == tokenizer.decode(ids)
    assert "\ufffd" not in emitted
