"""Where ``--ray`` work runs: a private instance on this machine, and a
running cluster of several nodes that the commands join by its address.

The cluster of several nodes here is two raylets on this machine (Ray's own
``ray.cluster_utils.Cluster``), one CPU each, on loopback: work that needs a
whole CPU per actor or task can only use both CPUs by using both nodes, so
what is compared below really crossed a node boundary. It is not a second
machine: a shared file system would hide a file written on the wrong node,
which is why every result comes back to the driver as a value (tests of
``bench tools`` check that its traces do).
"""

from __future__ import annotations

import ipaddress
import json

import pytest

from sim.cli import main
from sim.explore.modelcheck.model import SCOPES
from sim.explore.modelcheck.search import check

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")


def _listening(pids: set[int]) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket these processes listen on."""
    import psutil

    out = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            name = process.name()
            connections = process.net_connections(kind="tcp")
        except psutil.NoSuchProcess:  # a worker that ended meanwhile
            continue
        out += [(c.laddr.ip, c.laddr.port, name) for c in connections
                if c.status == psutil.CONN_LISTEN]
    return out


def _on_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # [::ffff:127.0.0.1]
    return (mapped or ip).is_loopback


def test_a_local_instance_listens_on_loopback_only() -> None:
    """``--ray local`` is private to this machine. Ray on its own replaces
    127.0.0.1 by the machine's routable address and listened on every
    interface (its control store, raylet, workers): this failed before
    `sim.explore.cluster.loopback`."""
    import psutil

    from sim.explore.cluster import Cluster

    with Cluster("local") as cluster:
        assert [n["NodeManagerAddress"] for n in cluster.ray.nodes()] == ["127.0.0.1"]
        started = {p.pid for p in psutil.Process().children(recursive=True)}
        sockets = _listening(started)
        names = {name for _, _, name in sockets}
        assert {"gcs_server", "raylet"} <= names, sockets  # the check saw Ray's servers
        exposed = [s for s in sockets if not _on_loopback(s[0])]
        assert not exposed, f"listening beyond loopback: {exposed}"
    # The switch is Ray's process-wide constant: back as it was, so that
    # joining a real cluster later reports the routable address again.
    import ray._private.ray_constants as constants

    assert constants.ENABLE_RAY_CLUSTER is True


@pytest.fixture(scope="module")
def two_nodes():
    """A running cluster the commands join by address: a head and a second
    node, one CPU each, on loopback."""
    from ray.cluster_utils import Cluster as RayCluster

    from sim.explore.cluster import loopback

    with loopback():
        nodes = RayCluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False})
        nodes.add_node(num_cpus=1)
        nodes.wait_for_nodes()
    yield nodes.address
    if ray.is_initialized():
        ray.shutdown()
    nodes.shutdown()


def test_joining_a_cluster_uses_its_nodes_and_leaves_it_running(two_nodes) -> None:
    from sim.explore.cluster import Cluster

    with Cluster(two_nodes) as cluster:
        assert cluster.started and cluster.cpus == 2
        alive = [n for n in cluster.ray.nodes() if n["Alive"]]
        assert len(alive) == 2
        assert {n["NodeManagerAddress"] for n in alive} == {"127.0.0.1"}
    assert not ray.is_initialized()  # this process left ...
    with Cluster(two_nodes) as again:  # ... and the cluster is still there
        assert again.cpus == 2


def test_a_campaign_on_two_nodes_matches_one_process(two_nodes) -> None:
    from sim.explore.campaign import campaign, comparable
    from sim.simulator.runner import SimOptions

    base = SimOptions(requests=24)
    alone = campaign("e1", seeds=4, base=base)
    joined = campaign("e1", seeds=4, base=base, ray_address=two_nodes)
    assert alone.counts and comparable(joined) == comparable(alone)


def test_the_model_checker_on_two_nodes_matches_one_process(two_nodes, tmp_path) -> None:
    """One actor per CPU, so one actor on each node; the counterexample is
    written by the driver and replays."""
    from sim.explore.cluster import Cluster
    from sim.traces.replay import replay_trace

    alone = check(SCOPES["default"], "kvstate", out_dir=None)
    buggy = check(SCOPES["twins"], "save-on-loading-step", out_dir=None)
    with Cluster(two_nodes) as cluster:
        r = check(SCOPES["default"], "kvstate", out_dir=None, workers=2, cluster=cluster)
        found = check(SCOPES["twins"], "save-on-loading-step", out_dir=str(tmp_path),
                      workers=2, cluster=cluster)
    assert r.workers == 2 and r.outcome == alone.outcome
    assert found.outcome == buggy.outcome
    assert found.violation.trace is not None and replay_trace(found.violation.trace).ok


def test_the_commands_take_the_cluster_address(two_nodes, capsys) -> None:
    assert main(["modelcheck", "--scope", "tiny", "--ray", two_nodes, "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    alone = check(SCOPES["tiny"], "kvstate", out_dir=None)
    assert (run["states"], run["exhaustive"], run["workers"]) == (alone.states, True, 2)
    assert main(["campaign", "--protocol", "e1", "--seeds", "2", "--ray", two_nodes]) == 1
    assert "reproduce: kvstate sim" in capsys.readouterr().out


def test_an_address_with_no_cluster_is_a_usage_error(capsys) -> None:
    """Nothing listens there (a port of loopback that was just free)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["modelcheck", "--scope", "tiny", "--ray", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "Traceback" not in err


def test_the_model_checker_survives_its_actors_dying(two_nodes, monkeypatch) -> None:
    """An actor killed between levels (as when its node is lost) is started
    again with nothing it was told: the same states, transitions and verdict
    as one process. Before actors were restartable this raised
    RayActorError."""
    import sim.explore.modelcheck.compact as mc
    from sim.explore.cluster import Cluster

    kills = []

    class Killing(mc._RayPool):
        def expand(self, level, visited, expander):
            if len(kills) < 2 and len(visited) > 200 * (len(kills) + 1):
                kills.append(len(visited))
                self.cluster.ray.kill(self.actors[len(kills) % 2], no_restart=False)
            return super().expand(level, visited, expander)

    monkeypatch.setattr(mc, "_RayPool", Killing)
    alone = check(SCOPES["default"], "kvstate", out_dir=None)
    with Cluster(two_nodes) as cluster:
        r = check(SCOPES["default"], "kvstate", out_dir=None, workers=2, cluster=cluster)
    assert len(kills) == 2  # both actors died once, at different levels
    assert r.outcome == alone.outcome


def test_an_actor_that_keeps_dying_is_a_clear_error(two_nodes, monkeypatch, capsys) -> None:
    import sim.explore.modelcheck.compact as mc

    class Doomed(mc._RayPool):
        def expand(self, level, visited, expander):
            self.cluster.ray.kill(self.actors[0])  # no restart left (ACTOR_RESTARTS is 0)
            return super().expand(level, visited, expander)

    monkeypatch.setattr(mc, "_RayPool", Doomed)
    monkeypatch.setattr(mc, "ACTOR_RESTARTS", 0)
    assert main(["modelcheck", "--scope", "default", "--ray", two_nodes]) == 2
    err = capsys.readouterr().err
    assert "died more than 0 times" in err and "Traceback" not in err


def test_bench_campaign_measures_the_cluster_on_the_same_seeds(two_nodes) -> None:
    from sim.bench.campaign import bench_campaign
    from sim.explore.cluster import Cluster

    figures = bench_campaign(seeds=2, protocol="e1", workers=[1],
                             connect=lambda: Cluster(two_nodes))
    assert figures["same_results"] is True  # the Ray run folded to the local result
    assert figures["ray_cpus"] == 2
    assert figures["seeds_per_s_ray"] > 0 and figures["speedup_ray"] > 0


def test_workers_forked_beside_ray_end_quietly(capfd) -> None:
    """A campaign's worker processes forked after Ray started here inherit
    Ray's crash handler; ended by their pool (SIGTERM), each printed a stack
    dump until workers took their signals back (`sim.explore.workers`)."""
    from sim.explore.campaign import campaign
    from sim.explore.cluster import Cluster
    from sim.simulator.runner import SimOptions

    with Cluster("local"):
        for _ in range(3):  # the dump came from most pools' ends, not every one
            result = campaign("kvstate", seeds=2, workers=2, base=SimOptions(requests=24))
            assert result.runs == 2
    err = capfd.readouterr().err
    assert "SIGTERM received" not in err


def test_a_cluster_running_other_code_is_refused(two_nodes, monkeypatch, capsys) -> None:
    """Every node is asked what it imports; a node with other sources would
    fold its findings into this process's result. Here this process
    pretends to run other code than the nodes (which import the files)."""
    import sim.explore.cluster

    real = sim.explore.cluster.node_code()
    assert real[0] == sim.explore.cluster.code_fingerprint() and len(real[0]) == 16
    # Only this process's fingerprint: the probe runs `node_code` on the
    # nodes, where the files decide.
    monkeypatch.setattr(sim.explore.cluster, "code_fingerprint", lambda: "0" * 16)
    with pytest.raises(RuntimeError) as e:
        sim.explore.cluster.Cluster(two_nodes)
    message = str(e.value)
    assert message.count("node 127.0.0.1 runs sources " + real[0]) == 2  # both nodes named
    assert "Install this kvstate on every node" in message
    assert not ray.is_initialized()  # the refused connection was closed
    assert main(["campaign", "--seeds", "1", "--ray", two_nodes]) == 2
    assert "other kvstate code" in capsys.readouterr().err


def test_local_starts_its_own_instance_beside_a_running_cluster(two_nodes) -> None:
    """``local`` means private: with ``ray.init()``'s default address it
    joined the cluster already running on this machine (here the two-node
    one) and used its nodes."""
    from sim.explore.cluster import Cluster

    def alive(cluster) -> set[str]:
        return {n["NodeID"] for n in cluster.ray.nodes() if n["Alive"]}

    with Cluster(two_nodes) as joined:
        running = alive(joined)
    with Cluster("local") as cluster:
        private = alive(cluster)
    assert len(running) == 2 and len(private) == 1 and not private & running
    with Cluster(two_nodes) as joined:  # the running one is untouched
        assert alive(joined) == running


def test_a_campaign_of_several_protocols_connects_once(two_nodes, monkeypatch, capsys) -> None:
    """One connection for the whole command, as the model checker has: it
    connected (and, for ``local``, started Ray) once per protocol."""
    inits = []
    real = ray.init

    def counting(*args, **kwargs):
        inits.append(kwargs.get("address"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ray, "init", counting)
    assert main(["campaign", "--protocol", "e1", "--protocol", "kvstate", "--seeds", "2",
                 "--ray", two_nodes, "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "e1" in out and "kvstate" in out
    assert inits == [two_nodes]


# ---------------------------------------------------------------------------
# Nodes that join a running cluster after this process checked it (an
# autoscaler adds them while a campaign runs): real nodes whose workers
# import other files, put first on their path with PYTHONPATH.


def _other_sources(root, change: str):
    """A copy of this checkout's kvstate and sim under ``root``, with
    ``change`` appended to kvstate's __init__.py (a comment: other code that
    still runs; a raise: a node that cannot import kvstate at all)."""
    import shutil
    from pathlib import Path

    import kvstate
    import sim

    for package in (kvstate, sim):
        source = Path(package.__file__).parent
        shutil.copytree(source, root / source.name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    if change:
        with open(root / "kvstate" / "__init__.py", "a") as f:
            f.write("\n" + change + "\n")
    return root


@pytest.fixture
def growing(tmp_path, monkeypatch):
    """A running cluster whose head offers no CPU, so that every task and
    actor runs on the nodes the test adds after joining. This process's
    working directory moves to an empty one: Ray puts the driver's working
    directory first on every worker's path, which would hide the nodes'
    own sources."""
    from ray.cluster_utils import Cluster as RayCluster

    from sim.explore.cluster import loopback

    here = tmp_path / "driver"
    here.mkdir()
    monkeypatch.chdir(here)
    with loopback():
        nodes = RayCluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "include_dashboard": False})

    def add(sources) -> None:
        with loopback():
            nodes.add_node(num_cpus=1, env_vars={"PYTHONPATH": str(sources)})
            nodes.wait_for_nodes()

    yield nodes.address, add
    if ray.is_initialized():
        ray.shutdown()
    nodes.shutdown()


def test_a_node_that_joins_later_with_other_code_is_refused(growing, tmp_path, capsys) -> None:
    """The node joined after the connection's check, so only the tasks'
    and actors' own check sees it. Before it, the campaign folded the other
    code's findings in, and the model checker counted its states."""
    from sim.bench.tools import bench_tools
    from sim.explore.campaign import campaign
    from sim.explore.cluster import Cluster, ClusterError
    from sim.simulator.runner import SimOptions

    address, add = growing
    with Cluster(address) as cluster:  # only the head: it passes the check
        add(_other_sources(tmp_path / "other", "# another build"))
        with pytest.raises(ClusterError) as e:
            campaign("e1", seeds=2, base=SimOptions(requests=24), ray_address=address)
        message = str(e.value)
        assert "node 127.0.0.1 runs sources " in message and "Install this kvstate" in message
        with pytest.raises(ClusterError, match="runs sources"):
            check(SCOPES["default"], "kvstate", out_dir=None, workers=2, cluster=cluster)
        with pytest.raises(ClusterError, match="runs sources"):
            bench_tools(["e1"], sim_budget=1, mc_budget=1, out_dir=str(tmp_path),
                        cluster=cluster)
        # The command line, on the connection this process holds: exit 2, no traceback.
        assert main(["campaign", "--seeds", "2", "--ray", address, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert "runs sources" in err and "Traceback" not in err


def test_a_node_that_cannot_import_kvstate_is_named(growing, tmp_path) -> None:
    """At the connection's check (the probe's error) and, for a node that
    joins after it, from the task that could not start there."""
    from sim.explore.campaign import campaign
    from sim.explore.cluster import Cluster, ClusterError
    from sim.simulator.runner import SimOptions

    address, add = growing
    broken = _other_sources(tmp_path / "broken",
                            'raise ImportError("kvstate is broken on this node")')
    with Cluster(address):
        add(broken)
        with pytest.raises(ClusterError) as e:
            campaign("e1", seeds=2, base=SimOptions(requests=24), ray_address=address)
    assert "node 127.0.0.1 cannot run kvstate (ImportError: kvstate is broken on this node)" \
        in str(e.value)
    assert not ray.is_initialized()
    with pytest.raises(ClusterError) as e:  # now it is there when joining
        Cluster(address)
    assert "cannot run kvstate" in str(e.value) and "kvstate is broken on this node" \
        in str(e.value)


def test_a_node_with_the_same_code_that_joins_later_is_used(growing, tmp_path) -> None:
    """The check refuses only other code: a node with this checkout's
    sources (a copy, so its own files) runs the campaign."""
    from sim.explore.campaign import campaign, comparable
    from sim.explore.cluster import Cluster
    from sim.simulator.runner import SimOptions

    address, add = growing
    base = SimOptions(requests=24)
    alone = campaign("e1", seeds=2, base=base)
    with Cluster(address):
        add(_other_sources(tmp_path / "same", ""))
        joined = campaign("e1", seeds=2, base=base, ray_address=address)
    assert comparable(joined) == comparable(alone)


def test_a_search_stopped_on_the_cluster_goes_on_here_and_back(two_nodes, tmp_path) -> None:
    """A checkpoint is the driver's: written while the levels were expanded
    by actors on two nodes, it goes on in this process alone, and back on
    the cluster, to the answer of a search that never stopped."""
    import itertools

    from sim.explore.cluster import Cluster
    from sim.explore.modelcheck.checkpoint import load

    def after(merges):
        asked = itertools.count()
        return lambda: next(asked) >= merges

    path = str(tmp_path / "c.ckpt")
    whole = check(SCOPES["default"], "kvstate", out_dir=None)
    with Cluster(two_nodes) as cluster:
        first = check(SCOPES["default"], "kvstate", out_dir=None, workers=2, cluster=cluster,
                      stop=after(600), checkpoint=path)
        assert first.interrupted and first.workers == 2
        here = check(SCOPES["default"], "kvstate", out_dir=None, stop=after(600),
                     checkpoint=path, resume=load(path))
        assert here.interrupted
        back = check(SCOPES["default"], "kvstate", out_dir=None, workers=2, cluster=cluster,
                     checkpoint=path, resume=load(path))
    assert back.outcome == whole.outcome


def test_bench_tools_on_two_nodes_matches_one_process(two_nodes, tmp_path) -> None:
    """A variant's row as a task on the cluster: the same findings as here,
    and its counterexample traces land in this process's ``out_dir`` (the
    node wrote them in a scratch directory of its own) and replay."""
    from sim.bench.tools import bench_tools
    from sim.explore.cluster import Cluster
    from sim.traces.replay import replay_trace

    def findings(rows):
        return {name: {tool: {k: v for k, v in row[tool].items()
                              if k not in ("seconds", "trace")} if isinstance(row[tool], dict)
                       else row[tool] for tool in row} for name, row in rows.items()}

    here = bench_tools(["e1", "key-without-rank"], sim_budget=20, mc_budget=20,
                       out_dir=str(tmp_path / "here"))
    with Cluster(two_nodes) as cluster:
        there = bench_tools(["e1", "key-without-rank"], sim_budget=20, mc_budget=20,
                            out_dir=str(tmp_path / "there"), cluster=cluster)
    assert findings(there) == findings(here)
    for row in there.values():
        trace = row["modelcheck"]["trace"]
        assert trace.startswith(str(tmp_path / "there")) and replay_trace(trace).ok


def test_the_model_checkers_table_on_the_cluster_is_the_whole_search(two_nodes, capsys) -> None:
    """The actors record what fired and the driver adds it up: the same
    table, and the same "never fired" list, as one process. Before, the
    driver's table held only the first, narrow levels it expanded itself
    (decode2: 10 of 61 entries, against 36) and called the rest never fired."""
    assert main(["modelcheck", "--scope", "decode2", "--workers", "1", "--no-progress"]) == 0
    alone = capsys.readouterr().out
    assert main(["modelcheck", "--scope", "decode2", "--ray", two_nodes, "--no-progress"]) == 0
    joined = capsys.readouterr().out

    def table(out: str) -> str:
        return out[out.index("table entries fired"):]

    assert "(2 workers)" in joined and table(joined) == table(alone)
