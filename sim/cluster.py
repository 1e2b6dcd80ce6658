"""A Ray cluster: where ``--ray ADDRESS`` work runs.

Three commands can spread their work over a cluster: ``kvstate campaign``
(seeds as tasks), ``kvstate modelcheck`` (each breadth-first level's
frontier in slices, one stateful actor per CPU) and ``kvstate bench tools``
(a variant's row as a task). They share this connection: Ray is an optional
extra (``pip install 'kvstate[ray]'``), so a missing install is an error
that says what to install (the CLI turns it into exit 2), never a bare
``ImportError``; ``local`` starts a private instance on this machine (what
CI tests against) and shuts it down afterwards; any other address joins a
running cluster, which is left running. A cluster the process already
joined (``ray.init`` called by the caller) is used as it is.

Every caller folds results in submission order, never in arrival order, so
a cluster run gives the same answer as one process (the tests compare them).
Code runs on the cluster's nodes by import, so kvstate must be installed
there at the same version.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

INSTALL_HINT = "pip install 'ray>=2.9' (or the project's ray extra: pip install 'kvstate[ray]')"


class Cluster:
    """A connection to a Ray cluster (a context manager: `close` on exit)."""

    def __init__(self, address: str) -> None:
        if not address:
            raise RuntimeError("--ray needs an address: 'local' (start one here) or a "
                               "cluster's, e.g. ray://head:10001 or auto")
        try:
            import ray
        except ImportError as e:
            raise RuntimeError(f"--ray needs Ray: {INSTALL_HINT}") from e
        self.ray: Any = ray
        self.address = address
        self.started = not ray.is_initialized()
        if self.started:
            try:
                ray.init(address=None if address == "local" else address,
                         include_dashboard=False, log_to_driver=False,
                         ignore_reinit_error=True)
            except ConnectionError as e:  # no cluster at that address
                raise RuntimeError(f"--ray {address}: no Ray cluster there ({e})") from e

    @property
    def cpus(self) -> int:
        """CPUs the cluster offers (at least 1): how many tasks or actors run at once."""
        return max(1, int(self.ray.cluster_resources().get("CPU", 1)))

    def get(self, handle: Any) -> Any:
        """A task's or actor call's result (its exception re-raised here)."""
        return self.ray.get(handle)

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


__all__ = ["INSTALL_HINT", "Cluster"]
