"""A Ray cluster: where ``--ray ADDRESS`` work runs.

These commands can spread their work over a cluster: ``kvstate campaign``
(seeds as tasks), ``kvstate modelcheck`` (each breadth-first level's
frontier in slices, one stateful actor per CPU), ``kvstate bench tools``
(a variant's row as a task) and ``kvstate bench campaign`` (the same seeds
as tasks, to measure the cluster). They share this connection: Ray is an optional
extra (``pip install 'kvstate[ray]'``), so a missing install is an error
that says what to install (the CLI turns it into exit 2), never a bare
``ImportError``; ``local`` starts a private instance on this machine (what
CI tests against) and shuts it down afterwards; any other address joins a
running cluster, which is left running. A cluster the process already
joined (``ray.init`` called by the caller) is used as it is.

A private instance listens on loopback only (`loopback`). Left to itself,
Ray swaps ``127.0.0.1`` for the machine's routable address, so a plain
``ray.init()`` had its control store, raylet and workers listening on every
interface and talking over the network address: a private instance reachable
from the network. Ray has no public switch for this; its
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (single-node mode, the default on
macOS and Windows) keeps every address on loopback, for the processes Ray
starts (they read the environment) and for this one (which read it when
``ray`` was imported, so the constant is set too, for the start only).

Every caller folds results in submission order, never in arrival order, so
a cluster run gives the same answer as one process (the tests compare them).
Code runs on the cluster's nodes by import, so kvstate must be installed
there at the same version; and since a node with other code would fold its
findings into the same result, silently, joining a cluster first asks every
node for a fingerprint of the kvstate and sim sources it imports
(`code_fingerprint`) and refuses a cluster where any differs from this
process's, naming the node. Nodes join a running cluster later too (an
autoscaler adds them while a campaign runs), so every task and every
model-checker actor checks its own node again before it does any work
(`run_checked`, `require_code`: a cached fingerprint, a comparison), and a
node that fails that check, or cannot import kvstate at all, stops the
command with a `ClusterError` naming it (`Cluster.get`) instead of folding
its answer in.

What is the cluster's fault and what is the protocol's: a `ClusterError`
(no Ray, nothing at the address, a node with other code or none, an actor
lost for good) is a usage error on the command line (exit 2, no traceback);
anything else a task raises is the code's own, re-raised with its traceback
(a crash in the core is a finding).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

INSTALL_HINT = "pip install 'ray>=2.9' (or the project's ray extra: pip install 'kvstate[ray]')"

# How long `Cluster` waits for a TCP answer from an address given as
# host:port before saying nothing is there. Ray itself retries a dead
# address for ~13 minutes, silently: NUM_REDIS_GET_RETRIES (20) tries in
# ray/_private/node.py, each a GcsClient that waited ~40 s here.
PROBE_SECONDS = 5.0

# The last line of a task's error when its node could not import what the
# task needs (kvstate missing, broken, or of another layout there).
_IMPORT_FAILURES = ("ImportError", "ModuleNotFoundError")

# Ray's single-node switch (ray/_private/ray_constants.py: ENABLE_RAY_CLUSTER):
# off, every address Ray picks for this machine is the loopback address.
_SINGLE_NODE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class ClusterError(RuntimeError):
    """The cluster failed, not the protocol: Ray missing, nothing at the
    address, a node running other kvstate code or unable to import it, an
    actor lost for good. The command line makes it a usage error (exit 2)."""


class OtherCode(Exception):
    """Raised on a node, before any work, when it runs other kvstate code
    than the driver (`run_checked`, `require_code`)."""


@contextlib.contextmanager
def loopback() -> Iterator[None]:
    """Ray processes started inside this block listen and talk on loopback
    only (the module docstring says why). For ``local`` instances, and for a
    test that starts a cluster of several nodes on this machine
    (``ray.cluster_utils.Cluster``). Everything is restored on exit: a later
    connection to a real cluster in the same process must report this
    machine's routable address again."""
    import ray._private.ray_constants as constants

    before_env = os.environ.get(_SINGLE_NODE)
    # A private name: should a Ray release drop it, only the environment is
    # set (enough when ray was not imported yet), and the loopback test fails.
    before = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    os.environ[_SINGLE_NODE] = "0"
    if before is not None:
        constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if before is not None:
            constants.ENABLE_RAY_CLUSTER = before
        if before_env is None:
            os.environ.pop(_SINGLE_NODE, None)
        else:
            os.environ[_SINGLE_NODE] = before_env


def _host_port(address: str) -> tuple[str, int] | None:
    """``host:port`` (``ray://host:port`` too) split; None for ``auto`` and
    other forms, which Ray resolves itself (and answers quickly)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


def _answers(host: str, port: int) -> OSError | None:
    """None if something accepts a TCP connection at ``host:port`` within
    `PROBE_SECONDS`, else why not."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=PROBE_SECONDS):
            return None
    except OSError as e:
        return e


def _require(address: str, host: str, port: int) -> None:
    why = _answers(host, port)
    if why is not None:
        raise ClusterError(f"--ray {address}: no Ray cluster there (nothing answered at "
                           f"{host}:{port} within {PROBE_SECONDS:g} s: {why})")


def _on_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _join(ray: Any, address: str, options: dict[str, Any]) -> None:
    """``ray.init`` at ``address``, failing at once (saying where) when
    nothing answers there instead of Ray's silent ~13-minute retry.

    A loopback address needs care: Ray connects to this machine's routable
    address instead, which reaches a cluster listening on every interface
    (``ray start`` without more) but not one listening on loopback only (a
    cluster started in single-node mode, as `loopback` starts them). So if
    the routable address does not answer and loopback does, the join is made
    in loopback mode too."""
    loopback_only = False
    where = _host_port(address)
    if where is not None:
        host, port = where
        if not address.startswith("ray://") and _on_loopback(host):
            routable = str(ray.util.get_node_ip_address())
            loopback_only = routable != host and _answers(routable, port) is not None
        _require(address, host, port)
    with loopback() if loopback_only else contextlib.nullcontext():
        ray.init(address=address, **options)


@functools.cache
def code_fingerprint() -> str:
    """A digest of the kvstate and sim sources this process imports (every
    ``.py`` file's path in its package and its bytes): equal on two machines
    exactly when they run the same code, whatever the version string says
    (an editable install, a local change)."""
    import hashlib
    import importlib
    from pathlib import Path

    digest = hashlib.sha256()
    for name in ("kvstate", "sim"):
        root = Path(importlib.import_module(name).__file__ or "").parent
        for path in sorted(root.rglob("*.py")):
            digest.update(path.relative_to(root.parent).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def node_code() -> tuple[str, str, str]:
    """What a node runs: (source fingerprint, kvstate's version, Python's)."""
    return (code_fingerprint(), *_versions())


@functools.cache
def _versions() -> tuple[str, str]:
    """kvstate's installed version and Python's (cached: every task on a
    node asks, and reading the installed metadata costs a file search)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("kvstate")
    except PackageNotFoundError:  # run from a checkout, not installed
        installed = "not installed"
    return installed, platform.python_version()


def _code(code: tuple[str, ...]) -> str:
    """A `node_code` as text: ``sources F (kvstate V, Python P)``."""
    return f"sources {code[0]} (kvstate {code[1]}, Python {code[2]})"


def _describe(where: str, code: tuple[str, ...]) -> str:
    return f"node {where} runs {_code(code)}"


def _cannot_run(where: str, error: BaseException) -> str:
    """A node whose task failed to import kvstate: the error's last line says why."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"node {where} cannot run kvstate ({lines[-1] if lines else type(error).__name__})"


def require_code(expected: tuple[str, ...]) -> None:
    """On a node: raise `OtherCode` unless it runs ``expected`` (the driver's
    `node_code`). A node checked when the driver joined passes; this is for
    the nodes that joined since, and for an actor started again elsewhere."""
    there = node_code()
    if there != tuple(expected):
        import ray

        raise OtherCode(_describe(ray.util.get_node_ip_address(), there))


def run_checked(expected: tuple[str, ...], fn: Any, *args: Any) -> Any:
    """``fn(*args)`` as a Ray task, on a node known to run ``expected``
    (`Cluster.task` submits every task through this)."""
    require_code(expected)
    return fn(*args)


def node_problem(error: BaseException) -> str | None:
    """What a Ray error says about a node, if it is the node's fault: it
    runs other code (`OtherCode`, raised by a task or by an actor's
    constructor) or could not import what the task needs. None for any
    other error (the task's own, to be re-raised as it is)."""
    import re

    cause = getattr(error, "cause", None)
    if isinstance(cause, OtherCode):
        return str(cause)
    text = str(error)
    marker = f"{OtherCode.__name__}: "
    if marker in text:  # an actor's constructor: only the text comes back
        return text.rsplit(marker, 1)[1].splitlines()[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and lines[-1].startswith(_IMPORT_FAILURES):
        found = re.search(r"\bip=([^,)\s]+)", text)
        return _cannot_run(found.group(1) if found else "of the cluster", error)
    return None


def _check_code(ray: Any, address: str) -> None:
    """Refuse a cluster whose nodes run other kvstate code than this process
    (one probe task pinned to each live node; see the module docstring)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = node_code()
    probe = ray.remote(num_cpus=0)(node_code)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    handles = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote() for n in nodes]
    problems = []
    for node, handle in zip(nodes, handles):
        where = node.get("NodeManagerAddress", node["NodeID"])
        try:
            there = tuple(ray.get(handle))
        except Exception as e:  # the node could not even import it
            problems.append(_cannot_run(where, e))
            continue
        if there != here:
            problems.append(_describe(where, there))
    if problems:
        raise ClusterError(
            f"--ray {address}: the cluster runs other kvstate code than this process, "
            f"which runs {_code(here)}, and its findings would be folded in as if they "
            f"were this code's: {'; '.join(problems)}. Install this kvstate on every node.")


class Cluster:
    """A connection to a Ray cluster (a context manager: `close` on exit)."""

    def __init__(self, address: str) -> None:
        if not address:
            raise ClusterError("--ray needs an address: 'local' (start one here) or a "
                               "cluster's, e.g. ray://head:10001 or auto")
        try:
            import ray
        except ImportError as e:
            raise ClusterError(f"--ray needs Ray: {INSTALL_HINT}") from e
        self.ray: Any = ray
        self.address = address
        self.started = not ray.is_initialized()
        if self.started:
            options: dict[str, Any] = {
                "include_dashboard": False, "log_to_driver": False, "ignore_reinit_error": True}
            try:
                if address == "local":
                    # Ray's "local": a new instance even where one runs. With
                    # no address, ray.init() joined the newest cluster on this
                    # machine (RAY_ADDRESS, /tmp/ray/ray_current_cluster, a
                    # test's) instead of starting a private one.
                    with loopback():
                        ray.init(address="local", **options)
                else:
                    _join(ray, address, options)
            except ConnectionError as e:  # no cluster at that address
                raise ClusterError(f"--ray {address}: no Ray cluster there ({e})") from e
            except ValueError as e:  # Ray's address parser refused it ('::::')
                raise ClusterError(f"--ray {address!r}: not an address Ray can join ({e}); "
                                   "expected 'local', 'auto', HOST:PORT or "
                                   "ray://HOST:PORT") from None
            if address != "local":  # a private instance runs this process's files
                try:
                    _check_code(ray, address)
                except BaseException:
                    self.close()
                    raise

    @property
    def cpus(self) -> int:
        """CPUs the cluster offers (at least 1): how many tasks or actors run at once."""
        return max(1, int(self.ray.cluster_resources().get("CPU", 1)))

    def task(self, fn: Any, **options: Any) -> Callable[..., Any]:
        """``submit(*args)``: ``fn(*args)`` as a Ray task (``options`` as
        ``ray.remote`` takes them) that first checks its node runs this
        process's code (`run_checked`); `get` its handle."""
        remote = self.ray.remote(**options)(run_checked) if options else \
            self.ray.remote(run_checked)
        return functools.partial(remote.remote, node_code(), fn)

    def get(self, handle: Any) -> Any:
        """A task's or actor call's result. Its exception is re-raised here,
        as a `ClusterError` naming the node when the node was at fault
        (`node_problem`)."""
        try:
            return self.ray.get(handle)
        except self.ray.exceptions.RayError as e:
            problem = node_problem(e)
            if problem is None:
                raise
            raise ClusterError(
                f"--ray {self.address}: {problem}, not this process's code, which runs "
                f"{_code(node_code())}; its answers would have been folded in as if they "
                "were this code's. Install this kvstate on every node.") from None

    def close(self) -> None:
        """Shut down what this connection started (a joined cluster keeps running)."""
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()
        self.started = False

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


__all__ = ["INSTALL_HINT", "Cluster", "ClusterError", "OtherCode", "code_fingerprint",
           "loopback", "node_code", "node_problem", "require_code", "run_checked"]
