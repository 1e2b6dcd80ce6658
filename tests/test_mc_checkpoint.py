"""A model-checker search that stops (Ctrl-C, a budget, a state limit) and
goes on later from its checkpoint ends exactly as one that never stopped
(Ctrl-C itself, in a subprocess: `tests/test_interrupt.py`)."""

from __future__ import annotations

import itertools
import json
import pickle
from pathlib import Path

import pytest

from sim.cli import main
from sim.explore.modelcheck.checkpoint import DIGEST_BYTES, FORMAT, MAGIC, CheckpointError, load
from sim.explore.modelcheck.model import SCOPES
from sim.explore.modelcheck.search import check


def _after(merges: int):
    """A ``stop`` that says yes from the ``merges``-th frontier state on."""
    asked = itertools.count()
    return lambda: next(asked) >= merges


def _in_pieces(scope: str, protocol: str, path: str, merges: int, workers=(1, 2)) -> tuple:
    """Search ``scope`` stopping every ``merges`` frontier states and going
    on from the checkpoint, alternating the number of workers; the final
    result and how many runs it took."""
    r = check(SCOPES[scope], protocol, out_dir=None, workers=workers[0], stop=_after(merges),
              checkpoint=path)
    runs = 1
    while r.interrupted:
        r = check(SCOPES[scope], protocol, out_dir=None, workers=workers[runs % 2],
                  stop=_after(merges), checkpoint=path, resume=load(path))
        runs += 1
    return r, runs


@pytest.mark.parametrize("scope, protocol, merges", [
    ("default", "kvstate", 250),                 # exhaustive, clean
    ("twins", "save-on-loading-step", 40),       # its violation found after resuming
    ("pd", "kvstate", 40),                       # a P/D scope, clean
])
def test_a_search_stopped_again_and_again_ends_as_one_that_never_stopped(
        tmp_path, scope, protocol, merges) -> None:
    whole = check(SCOPES[scope], protocol, out_dir=None)
    pieces, runs = _in_pieces(scope, protocol, str(tmp_path / "search.ckpt"), merges)
    assert runs > 2  # it really stopped, more than once
    assert pieces.outcome == whole.outcome
    assert pieces.interrupted is False


def test_a_budget_stop_leaves_a_checkpoint_to_go_on_from(tmp_path) -> None:
    path = str(tmp_path / "b.ckpt")
    first = check(SCOPES["default"], "kvstate", out_dir=None, max_states=600, checkpoint=path)
    assert not first.exhaustive and not first.interrupted
    saved = load(path)
    assert len(saved.parents) == first.states and saved.transitions == first.transitions
    rest = check(SCOPES["default"], "kvstate", out_dir=None, resume=saved)
    assert rest.outcome == check(SCOPES["default"], "kvstate", out_dir=None).outcome


def test_checkpoints_are_written_as_levels_end(tmp_path) -> None:
    """With no pause between them, the file holds the last level reached
    (nothing waiting after the last one): going on from it finds nothing new."""
    path = str(tmp_path / "l.ckpt")
    whole = check(SCOPES["tiny"], "kvstate", out_dir=None, checkpoint=path,
                  checkpoint_every=0.0)
    saved = load(path)
    assert len(saved.parents) == whole.states and not saved.rest and not saved.following
    assert check(SCOPES["tiny"], "kvstate", out_dir=None, resume=saved).outcome == whole.outcome


def test_a_checkpoint_of_other_code_or_another_search_is_refused(tmp_path, monkeypatch) -> None:
    import sim.explore.cluster
    from sim.explore.modelcheck.checkpoint import require_same

    path = str(tmp_path / "o.ckpt")
    check(SCOPES["tiny"], "kvstate", out_dir=None, max_states=5, checkpoint=path)
    saved = load(path)
    with pytest.raises(CheckpointError, match="another scope"):
        require_same(saved, path, SCOPES["default"], "kvstate", True, None)
    with pytest.raises(CheckpointError, match="protocol 'kvstate', not 'e2'"):
        require_same(saved, path, SCOPES["tiny"], "e2", True, None)
    monkeypatch.setattr(sim.explore.cluster, "code_fingerprint", lambda: "0" * 16)
    with pytest.raises(CheckpointError, match="written by other kvstate code"):
        load(path)


def test_a_loaded_checkpoint_goes_on_once_and_only_with_its_own_search(tmp_path) -> None:
    path = str(tmp_path / "once.ckpt")
    check(SCOPES["default"], "kvstate", out_dir=None, max_states=300, checkpoint=path)
    saved = load(path)
    with pytest.raises(CheckpointError, match="another scope"):
        check(SCOPES["churn"], "kvstate", out_dir=None, resume=saved)
    with pytest.raises(CheckpointError, match="protocol 'kvstate', not 'e2'"):
        check(SCOPES["default"], "e2", out_dir=None, resume=saved)
    with pytest.raises(CheckpointError, match="reduction"):
        check(SCOPES["default"], "kvstate", out_dir=None, reduce=False, resume=saved)
    check(SCOPES["default"], "kvstate", out_dir=None, resume=saved)
    # Its frontiers were let go of: going on again would look like nothing
    # left to do (an exhaustive search of 300 states), so it is refused.
    with pytest.raises(ValueError, match="gone on from already"):
        check(SCOPES["default"], "kvstate", out_dir=None, resume=saved)
    again = check(SCOPES["default"], "kvstate", out_dir=None, resume=load(path))
    assert again.outcome == check(SCOPES["default"], "kvstate", out_dir=None).outcome


def test_bad_checkpoints_are_usage_errors_that_say_what_is_wrong(tmp_path, capsys) -> None:
    good = str(tmp_path / "good.ckpt")
    assert main(["modelcheck", "--scope", "tiny", "--max-states", "5", "--checkpoint", good,
                 "--no-progress"]) == 0
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(Path(good).read_bytes()[:500])
    older = tmp_path / "older.ckpt"  # the layout of format 3: this one with no digest
    older.write_bytes(_started_as(FORMAT - 1, Path(good).read_bytes()[:-DIGEST_BYTES]))
    other = tmp_path / "dict.ckpt"
    other.write_bytes(pickle.dumps({"states": 1}))
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    cases = [
        (["--resume", str(tmp_path / "missing.ckpt")], "cannot open (No such file"),
        (["--resume", str(text)], "not a model-checker checkpoint (it does not start like"),
        (["--resume", str(truncated)], f"{truncated}: a damaged checkpoint"),
        (["--resume", str(older)], f"checkpoint format {FORMAT - 1}; this kvstate reads "
                                   f"format {FORMAT}"),
        (["--resume", str(other)], "not a model-checker checkpoint (it starts with a dict)"),
        (["--resume", good, "--scope", "default"], "a checkpoint of scope 'tiny', not"),
        (["--resume", good, "--protocol", "e2"], "a checkpoint of protocol 'kvstate'"),
        (["--resume", good, "--no-reduction"], "--no-reduction would be another one"),
        (["--scope", "all", "--checkpoint", good], "--checkpoint holds one search"),
        (["--scope", "tiny", "--checkpoint", str(tmp_path / "no" / "such.ckpt")],
         f"--checkpoint {tmp_path / 'no' / 'such.ckpt'}: no directory"),
    ]
    for argv, expected in cases:
        assert main(["modelcheck", *argv, "--no-progress"]) == 2, argv
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, (argv, err)
    assert Path(good).read_bytes()[:1] == b"\x80"  # none of that touched the good one


def _started_as(format: int, data: bytes) -> bytes:
    """``data``, a checkpoint, as if it said it were of ``format``."""
    mine, theirs = (pickle.dumps((MAGIC, f), protocol=5) for f in (FORMAT, format))
    assert data.startswith(mine) and len(mine) == len(theirs)
    return theirs + data[len(mine):]


def _mid_level(tmp_path, scope: str = "churn", merges: int = 100) -> Path:
    """A real checkpoint of a search stopped inside a level: states visited,
    and states waiting in both frontiers."""
    path = tmp_path / f"{scope}.ckpt"
    check(SCOPES[scope], "kvstate", out_dir=None, stop=_after(merges), checkpoint=str(path))
    saved = load(str(path))
    assert saved.rest and saved.following and len(saved.parents) > merges
    return path


def test_a_checkpoint_damaged_at_any_byte_is_refused_when_it_is_loaded(tmp_path) -> None:
    """One byte changed anywhere (the start that says what the file is, the
    header, the visited table, a waiting state, the digest itself) is refused
    by `load` as damage: before, most such files loaded, their states to be
    unpickled mid-search (a traceback) or not at all (a wrong search, exit 0)."""
    good = _mid_level(tmp_path)
    data = good.read_bytes()
    start, end = range(128), range(len(data) - 96, len(data))
    spread = range(0, len(data), max(1, len(data) // 400))
    positions = sorted({*start, *spread, *end})
    assert len(positions) > 500
    damaged = tmp_path / "damaged.ckpt"
    for n, at in enumerate(positions):
        flipped = bytearray(data)
        flipped[at] ^= (0x01, 0x80, 0xFF)[n % 3]
        damaged.write_bytes(flipped)
        with pytest.raises(CheckpointError) as refused:
            load(str(damaged))
        assert str(refused.value).startswith(f"{damaged}: a damaged checkpoint"), (
            at, str(refused.value))
    assert good.read_bytes() == data and load(str(good)).rest  # the good one is untouched


def test_a_checkpoint_cut_short_or_added_to_is_refused_as_damaged(tmp_path) -> None:
    data = _mid_level(tmp_path, "default", 60).read_bytes()
    start = len(pickle.dumps((MAGIC, FORMAT), protocol=5))
    changed = tmp_path / "changed.ckpt"
    lengths = [0, 1, start - 1, start, start + 1, start + DIGEST_BYTES - 1,
               start + DIGEST_BYTES, len(data) // 3, len(data) // 2,
               len(data) - DIGEST_BYTES - 1, len(data) - DIGEST_BYTES,
               len(data) - DIGEST_BYTES + 1, len(data) - 1]
    for cut in [data[:n] for n in lengths] + [data + b"\0", data + data[-DIGEST_BYTES:]]:
        changed.write_bytes(cut)
        with pytest.raises(CheckpointError) as refused:
            load(str(changed))
        if len(cut) >= start:  # less is not even the start of one (the tests above)
            assert str(refused.value).startswith(f"{changed}: a damaged checkpoint"), (
                len(cut), str(refused.value))


def test_a_damaged_checkpoint_is_a_usage_error_before_the_search_starts(
        tmp_path, capsys) -> None:
    """The audit's case: ``churn`` stopped at 500 states, one byte of a
    waiting state changed, then resumed: exit 2 naming the file and what is
    wrong, no traceback, nothing searched, the file as it was; the intact
    file goes on."""
    good = str(tmp_path / "churn.ckpt")
    assert main(["modelcheck", "--scope", "churn", "--workers", "1", "--checkpoint", good,
                 "--max-states", "500", "--no-progress"]) == 0
    data = Path(good).read_bytes()
    capsys.readouterr()
    damaged = tmp_path / "damaged.ckpt"
    for at in (len(data) // 2, len(data) - DIGEST_BYTES - 100):
        flipped = bytearray(data)
        flipped[at] ^= 0x20
        damaged.write_bytes(flipped)
        assert main(["modelcheck", "--workers", "1", "--resume", str(damaged),
                     "--max-states", "1200", "--no-progress"]) == 2
        out, err = capsys.readouterr()
        assert f"{damaged}: a damaged checkpoint: its content does not match the checksum" \
            in err and "Traceback" not in err, err
        assert out == "" and damaged.read_bytes() == flipped
    assert main(["modelcheck", "--workers", "1", "--resume", good, "--max-states", "1200",
                 "--no-progress"]) == 0


def test_the_command_line_goes_on_from_a_budget_stop(tmp_path, capsys) -> None:
    path = str(tmp_path / "cli.ckpt")
    assert main(["modelcheck", "--scope", "default", "--max-states", "800", "--checkpoint",
                 path, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "NOT exhaustive (budget)" in out and f"--resume {path}" in out
    assert main(["modelcheck", "--resume", path, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["interrupted"] is False and report["exhaustive"] is True
    run = report["runs"][0]
    whole = check(SCOPES["default"], "kvstate", out_dir=None)
    assert (run["scope"], run["states"], run["transitions"], run["exhaustive"]) == (
        "default", whole.states, whole.transitions, True)
    assert run["interrupted"] is False and run["checkpoint"] is None


def test_a_search_whose_levels_go_to_disk_ends_as_one_in_memory(tmp_path, monkeypatch) -> None:
    """Every level past a byte of pickled states lives in a temporary file;
    stopped, checkpointed and resumed with its levels on disk, with one and
    two workers, the search ends as it does in memory."""
    import sim.explore.modelcheck.frontier
    from sim.explore.modelcheck.frontier import Frontier

    whole = check(SCOPES["default"], "kvstate", out_dir=None)
    spilled = []
    real = Frontier.append

    def watched(self, key, blob):
        real(self, key, blob)
        if self.spilled and self not in spilled:
            spilled.append(self)

    monkeypatch.setattr(sim.explore.modelcheck.frontier, "SPILL_BYTES", 1)
    monkeypatch.setattr(Frontier, "append", watched)
    pieces, runs = _in_pieces("default", "kvstate", str(tmp_path / "disk.ckpt"), 400)
    assert runs > 2 and len(spilled) > 10
    assert pieces.outcome == whole.outcome
    assert check(SCOPES["default"], "kvstate", out_dir=None, workers=2).outcome == whole.outcome


def test_a_frontier_keeps_its_order_across_memory_and_disk(tmp_path) -> None:
    from sim.explore.modelcheck.frontier import Frontier

    states = [(i.to_bytes(2, "big") * 8, bytes([i % 251]) * (i * 37 % 500)) for i in range(300)]
    for limit in (10**9, 5_000, 0):
        f = Frontier(spill_bytes=limit)
        f.extend(states[:150])
        assert [s for batch in f.batches(7) for s in batch] == states[:150]  # read ...
        f.extend(states[150:])  # ... then appended to, and read again
        assert list(f) == states and len(f) == 300
        assert f.spilled == (limit < 10**9)
        f.close()
        assert not f
        with pytest.raises(RuntimeError, match="let go of"):
            list(f)
