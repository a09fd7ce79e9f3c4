"""tools/memory_probe.py refuses, by name and before it launches any rank, the shapes its ring cannot run."""
import pytest


@pytest.mark.parametrize("argv, message", [
    (["--cp", "0"], "--cp sizes must be >= 1, got [0]"),
    (["--seq-local", "100"], "--seq-local must be a positive multiple of 64"),
    (["--heads", "3", "--kv-heads", "2"], "--heads 3 is not a multiple of --kv-heads 2"),
    (["--head-dim", "0"], "--head-dim must be >= 1, got 0"),
])
def test_memory_probe_refuses_bad_shapes_by_name(capsys, argv, message):
    from tools.memory_probe import main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
