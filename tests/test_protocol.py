"""The engine-worker protocol: token-state bookkeeping (blocks, completion, EOS stopping)
and the msgpack wire format."""

import pytest

from dilaserve.protocol import (
    CacheMode,
    ProtocolError,
    RequestState,
    Shutdown,
    StepCommand,
    StepEntry,
    StepKind,
    StepOutput,
    StepReport,
    TokenStateError,
    WorkerReady,
    decode_engine_message,
    decode_worker_message,
    encode,
)

M = 99


def test_new_rounds_output_to_whole_blocks():
    s = RequestState.new(1, [1, 2], 70, block_length=32, mask_token_id=M)
    assert s.output_length == 96
    assert s.num_masked == 96
    assert s.current_block == 0
    assert not s.done


@pytest.mark.parametrize("gen,block", [(0, 32), (-1, 32), (8, 0)])
def test_new_rejects_bad_lengths(gen, block):
    with pytest.raises(TokenStateError):
        RequestState.new(1, [1], gen, block_length=block, mask_token_id=M)


def test_current_block_and_done():
    s = RequestState.new(1, [1], 8, block_length=4, mask_token_id=M)
    s.output_ids[:4] = [5, 6, 7, 8]
    assert s.current_block == 1
    s.output_ids[4:] = [1, 1, 1, 1]
    assert s.done and s.current_block == 2 and s.first_masked() is None


def test_a_stop_token_stops_only_when_everything_before_it_is_unmasked():
    s = RequestState.new(1, [1], 8, block_length=4, mask_token_id=M, stop_token_ids=[3, 9])
    s.output_ids = [5, M, 9, M, M, 3, M, M]
    assert not s.done
    s.output_ids[1] = 6
    assert s.done and s.stop_position == 2
    assert s.generated_ids() == [5, 6]


def test_fixed_schedule_splits_each_block_into_equal_shares():
    s = RequestState.new(1, [1], 8, block_length=8, mask_token_id=M, steps_per_block=3)
    counts = []
    for steps in range(3):
        s.block_steps = steps
        counts.append(s.transfer_count())
    assert counts == [3, 3, 2]
    with pytest.raises(TokenStateError, match="steps_per_block"):
        RequestState.new(1, [1], 8, block_length=8, mask_token_id=M, steps_per_block=0)
    with pytest.raises(TokenStateError, match="temperature"):
        RequestState.new(1, [1], 8, block_length=8, mask_token_id=M, temperature=-1.0)


def test_commit_advances_the_state_block_by_block():
    s = RequestState.new(1, [1], 8, block_length=4, mask_token_id=M)
    s.commit(0, [0, 2], [5, 6])
    assert s.output_ids[:4] == [5, M, 6, M] and s.steps_done == 1 and s.block_steps == 1
    s.commit(0, [1, 3], [7, 8])
    assert s.current_block == 1 and s.block_steps == 0 and s.complete_blocks == 1


def test_messages_round_trip_through_msgpack():
    state = RequestState.new(
        7, [1, 2], 8, block_length=4, mask_token_id=M, stop_token_ids=[3], temperature=0.5
    )
    command = StepCommand.of(
        3, [StepEntry(7, 0.9, StepKind.RECOMPUTE)], admit=[state], release=[4, 5]
    )
    assert decode_engine_message(encode(command)) == command
    assert decode_engine_message(encode(Shutdown())) == Shutdown()
    report = StepReport(step=3, forward_tokens=12, seconds=0.01)
    row = StepOutput(7, StepKind.CACHE, 1, [4, 6], [9, 2], (0.1, 0.2, 0.3, 0.3, 0.4), False)
    report.add(row)
    decoded = decode_worker_message(encode(report))
    assert decoded == report and decoded.outputs == [row]
    assert decoded.outputs[0].kind is StepKind.CACHE
    ready = WorkerReady(1, 0, 42, CacheMode.DUAL, 64, None, 512, 46, "cpu")
    assert decode_worker_message(encode(ready)) == ready


@pytest.mark.parametrize(
    "frame",
    [b"", b"\x01", encode(Shutdown())[:-1] + b"\xc1", encode(StepReport(1))],
)
def test_bad_frames_raise_protocol_error(frame):
    with pytest.raises(ProtocolError):
        decode_engine_message(frame)


def test_a_wrongly_typed_field_is_a_protocol_error():
    frame = encode(StepCommand.of(1, [StepEntry(1, 0.5, StepKind.CACHE)]))
    bad = frame.replace(b"cache", b"cachX")
    with pytest.raises(ProtocolError):
        decode_engine_message(bad)


def test_models_never_import_the_worker():
    """The layers use the KV-cache interface in `models/`; the worker implements it."""
    import ast
    from pathlib import Path

    import dilaserve.models

    for path in Path(dilaserve.models.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("dilaserve.worker"), path.name
