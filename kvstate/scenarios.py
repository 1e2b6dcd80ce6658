"""Named scenarios: short, scripted runs that each exercise one hazard.

Each scenario builds a `Harness` for a protocol variant, drives it through a
precise interleaving (which rank performs which store call when, which store
answer fails), settles it, and returns it; the monitor's findings say which
invariants broke. The invariant catalogue names, for every invariant, a
scenario and a variant that break it; the tests run both that pair and the
default protocol on the same scenario. The interleavings are the ones the
upstream bugs needed (docs/invariants.md cites each bug), written down so they replay
exactly.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstate.config import ConnectorConfig, Role
from kvstate.harness import Harness
from kvstate.memory_store import MemoryStore, StoreRaised
from kvstate.store_codes import StoreCode
from kvstate.variants import Variant

Scenario = Callable[[str | Variant], Harness]
SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str) -> Callable[[Scenario], Scenario]:
    def register(fn: Scenario) -> Scenario:
        SCENARIOS[name] = fn
        return fn
    return register


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(salt * 1000 + i) % 50000 for i in range(n)]


class ScriptedAnswers:
    """Store answers by (operation, rank, nth call of that op on that rank)."""

    def __init__(self) -> None:
        self.rules: list[tuple[str, int | None, Callable[[int, str], bool], int | BaseException]] = []
        self.calls: dict[tuple[str, int], int] = {}

    def when(self, op: str, rank: int | None, match: Callable[[int, str], bool],
             answer: int | BaseException) -> ScriptedAnswers:
        self.rules.append((op, rank, match, answer))
        return self

    def __call__(self, op: str, rank: int, key: str) -> int | BaseException:
        n = self.calls.get((op, rank), 0)
        self.calls[(op, rank)] = n + 1
        for rule_op, rule_rank, match, answer in self.rules:
            if rule_op == op and rule_rank in (None, rank) and match(n, key):
                return answer
        return 0


@scenario("preempt-running-job")
def preempt_running_job(variant: str | Variant) -> Harness:
    """A job has checked existence and is about to put when its request is
    preempted; another request wants blocks right away (vLLM#52360)."""
    h = Harness(ConnectorConfig(block_size=4), variant, num_blocks=3)
    h.add("a", prompt(8), max_new_tokens=3)
    h.step()                       # a prefills 2 blocks; job 1 saves [0, 8)
    h.advance(0)                   # rank 0: exists → put pending
    h.add("b", prompt(8, salt=7))
    h.step(preempt=["a"], hold=["a"])  # blocks freed; vLLM admits nothing this step
    h.step(hold=["a"])             # b takes whatever blocks are free
    h.run_ranks()                  # the pending put reads a's blocks now
    h.settle()
    return h


@scenario("preempt-with-queued-job")
def preempt_with_queued_job(variant: str | Variant) -> Harness:
    """A job is still queued when its request is preempted and resumed."""
    h = Harness(ConnectorConfig(block_size=4, save_decode_cache=True), variant, num_blocks=16)
    h.add("a", prompt(8), max_new_tokens=4)
    h.step()                       # job 1 queued, not run
    h.step(preempt=["a"], hold=["a"])
    h.step()                       # a resumes: a new generation, job 2
    h.settle()
    return h


@scenario("reuse-with-stale-job")
def reuse_with_stale_job(variant: str | Variant) -> Harness:
    """A finished request's job is still queued when a client reuses its id
    with a shorter prompt (ABA: vLLM#51637)."""
    h = Harness(ConnectorConfig(block_size=4), variant, num_blocks=16)
    h.add("a", prompt(8))
    h.step()                       # job 1: [0, 8)
    h.step()                       # a finishes; job 1 still queued
    h.add("a", prompt(4, salt=3))
    h.step()                       # generation 2 of "a": job 2 [0, 4)
    h.settle()
    return h


@scenario("reuse-with-failed-retry")
def reuse_with_failed_retry(variant: str | Variant) -> Harness:
    """A generation's put fails (its token suffix is kept for the retry) and
    the request finishes; a client reuses the id. The new generation must not
    see the old one's retry suffix."""
    answers = ScriptedAnswers().when("put", 0, lambda n, k: n == 0, StoreCode.TRANSFER_FAIL)
    config = ConnectorConfig(block_size=4, enable_kv_events=True)
    h = Harness(config, variant, num_blocks=16, store=MemoryStore(answers))
    h.add("a", prompt(8))
    h.settle()
    h.add("a", prompt(8, salt=5))
    h.settle()
    return h


@scenario("reverse-ranks")
def reverse_ranks(variant: str | Variant) -> Harness:
    """Two ranks with distinct KV heads; rank 1 runs each job before rank 0."""
    config = ConnectorConfig(block_size=4, world_size=2, save_decode_cache=True)
    h = Harness(config, variant, num_blocks=32)
    h.add("a", prompt(8), max_new_tokens=6)
    for _ in range(12):
        h.step()
        h.run_rank(1)
        h.run_rank(0)
    h.settle()
    return h


@scenario("store-raises")
def store_raises(variant: str | Variant) -> Harness:
    """A put raises on one rank (vLLM#43742: without ``finally`` the job never
    reports and its pins leak)."""
    answers = ScriptedAnswers().when("put", 1, lambda n, k: n == 0, StoreRaised("boom"))
    config = ConnectorConfig(block_size=4, world_size=2, enable_kv_events=True)
    h = Harness(config, variant, num_blocks=16, store=MemoryStore(answers))
    h.add("a", prompt(8), max_new_tokens=2)
    h.settle()
    return h


@scenario("decode-save")
def decode_save(variant: str | Variant) -> Harness:
    """Plain decode saving with KV events on two ranks."""
    config = ConnectorConfig(block_size=4, world_size=2, save_decode_cache=True,
                             enable_kv_events=True)
    h = Harness(config, variant, num_blocks=32)
    h.add("a", prompt(6), max_new_tokens=12)
    h.settle()
    return h


@scenario("shared-prefix")
def shared_prefix(variant: str | Variant) -> Harness:
    """A second request shares the first one's two leading chunks: existence
    checks deduplicate them, and the new chunk's parent must still be the
    chain predecessor (vLLM#52466)."""
    config = ConnectorConfig(block_size=4, world_size=2, enable_kv_events=True)
    h = Harness(config, variant, num_blocks=32)
    h.add("a", prompt(12))
    h.settle()
    h.add("b", prompt(8) + prompt(4, salt=9))
    h.settle()
    return h


@scenario("partial-put-failure")
def partial_put_failure(variant: str | Variant) -> Harness:
    """The middle chunk's put fails once; the next decode job must retry it
    from the rank's saved offset (incremental saving, docs/background.md)."""
    answers = ScriptedAnswers().when("put", 0, lambda n, k: n == 1, StoreCode.TRANSFER_FAIL)
    config = ConnectorConfig(block_size=4, save_decode_cache=True, enable_kv_events=True)
    h = Harness(config, variant, num_blocks=32, store=MemoryStore(answers))
    h.add("a", prompt(12), max_new_tokens=8)
    h.settle()
    return h


@scenario("strided-events")
def strided_events(variant: str | Variant) -> Harness:
    """MLA-style striding (put_step = world size): each chunk is stored and
    announced by one rank; rank 1 reports before rank 0 every step."""
    config = ConnectorConfig(block_size=4, world_size=2, put_step=2, save_decode_cache=True,
                             enable_kv_events=True)
    h = Harness(config, variant, num_blocks=32)
    h.add("a", prompt(8), max_new_tokens=12)
    for _ in range(20):
        h.step()
        h.run_rank(1)
        h.run_rank(0)
    h.settle()
    return h


@scenario("evicted-and-reput")
def evicted_and_reput(variant: str | Variant) -> Harness:
    """Two requests with one prompt; rank 1's puts all fail; between rank 0's
    two jobs the store evicts the chunks, so rank 0 puts and announces them
    twice (S16: upstream's value-counting can publish early)."""
    answers = ScriptedAnswers().when("put", 1, lambda n, k: True, StoreCode.TRANSFER_FAIL)
    config = ConnectorConfig(block_size=4, world_size=2, enable_kv_events=True)
    store = MemoryStore(answers)
    h = Harness(config, variant, num_blocks=32, store=store)
    h.add("a", prompt(8))
    h.add("b", prompt(8))
    h.step()
    while h.advance(0) != "reported":
        pass
    for key in list(store.objects):
        h.evict(key)
    h.run_ranks()
    h.settle()
    return h


def _stored_then_looked_up(variant: str | Variant, config: ConnectorConfig,
                           store: MemoryStore | None = None, load_async: bool = False,
                           max_steps: int = 10_000) -> Harness:
    """Request "a" stores a 12-token prompt; then "b" with the same prompt looks
    the store up and loads what it finds."""
    h = Harness(config, variant, num_blocks=32, store=store)
    h.add("a", prompt(12))
    h.settle()
    h.add("b", prompt(12), lookup=True, load_async=load_async)
    h.settle(max_steps)
    return h


@scenario("load-hit")
def load_hit(variant: str | Variant) -> Harness:
    """A second request finds the first one's prompt in the store and loads it."""
    return _stored_then_looked_up(variant, ConnectorConfig(block_size=4))


@scenario("load-async")
def load_async(variant: str | Variant) -> Harness:
    """As load-hit, with the request parked until every rank loaded."""
    return _stored_then_looked_up(variant, ConnectorConfig(block_size=4, world_size=2),
                                  load_async=True)


@scenario("load-evicted")
def load_evicted(variant: str | Variant) -> Harness:
    """The lookup hits, then every get fails (evicted meanwhile): the failed
    blocks must be reported so the engine recomputes them (S19)."""
    answers = ScriptedAnswers().when("get", None, lambda n, k: True, StoreCode.OBJECT_NOT_FOUND)
    return _stored_then_looked_up(variant, ConnectorConfig(block_size=4),
                                  MemoryStore(answers))


@scenario("load-async-evicted")
def load_async_evicted(variant: str | Variant) -> Harness:
    """As load-async, every get failing while the store still says present:
    vLLM frees the parked request's blocks and admits it afresh; it computes
    the prompt without a second lookup or load (K8). Upstream looks it up
    again, loads, fails, for ever (bounded here at 100 steps)."""
    answers = ScriptedAnswers().when("get", None, lambda n, k: True, StoreCode.OBJECT_NOT_FOUND)
    return _stored_then_looked_up(variant, ConnectorConfig(block_size=4, world_size=2),
                                  MemoryStore(answers), load_async=True, max_steps=100)


@scenario("load-async-partial")
def load_async_partial(variant: str | Variant) -> Harness:
    """As load-async, rank 1's get of the second chunk failing: vLLM keeps
    the first block, and the request is scheduled from the second on."""
    answers = ScriptedAnswers().when("get", 1, lambda n, k: n == 1, StoreCode.OBJECT_NOT_FOUND)
    return _stored_then_looked_up(variant, ConnectorConfig(block_size=4, world_size=2),
                                  MemoryStore(answers), load_async=True)


@scenario("load-sync-partial")
def load_sync_partial(variant: str | Variant) -> Harness:
    """As load-async-partial with a synchronous load: the forward pass runs
    over the failed block, so vLLM cuts the request back to it after the
    step and it recomputes from there (its computed count goes backwards
    while it runs: the planner must not plan saves past what is computed,
    S7)."""
    answers = ScriptedAnswers().when("get", 1, lambda n, k: n == 1, StoreCode.OBJECT_NOT_FOUND)
    return _stored_then_looked_up(variant, ConnectorConfig(block_size=4, world_size=2),
                                  MemoryStore(answers))


@scenario("lookup-partial-namespace")
def lookup_partial_namespace(variant: str | Variant) -> Harness:
    """Only rank 0's namespace holds the prompt (rank 1's puts failed); a
    lookup must not count it as a hit."""
    answers = ScriptedAnswers().when("put", 1, lambda n, k: True, StoreCode.TRANSFER_FAIL)
    return _stored_then_looked_up(variant, ConnectorConfig(block_size=4, world_size=2),
                                  MemoryStore(answers))


@scenario("consumer-backfill")
def consumer_backfill(variant: str | Variant) -> Harness:
    """A decode node (kv_consumer + save_decode_cache) whose prompt arrived by
    direct P→D transfer, so the store lacks it: its first decode save must
    backfill the block-aligned prompt (decode-phase saving, docs/background.md)."""
    config = ConnectorConfig(role=Role.CONSUMER, block_size=4, save_decode_cache=True,
                             enable_kv_events=True)
    h = Harness(config, variant, num_blocks=32)
    h.add("a", prompt(10), max_new_tokens=10)
    h.settle()
    return h


@scenario("pressure-idle")
def pressure_idle(variant: str | Variant) -> Harness:
    """The only running request hits -200 (store full) once; nothing else
    puts, so only a backoff can bring its saves back (K6)."""
    answers = ScriptedAnswers().when("put", 0, lambda n, k: n == 0, StoreCode.NO_AVAILABLE_HANDLE)
    config = ConnectorConfig(block_size=4, save_decode_cache=True, pressure_backoff=2.0)
    h = Harness(config, variant, num_blocks=32, store=MemoryStore(answers))
    h.add("a", prompt(8), max_new_tokens=16)
    h.settle()
    return h


@scenario("snapshot-events")
def snapshot_events(variant: str | Variant) -> Harness:
    """Decode saving with KV events: every event carries the chunk's tokens."""
    config = ConnectorConfig(block_size=4, save_decode_cache=True, enable_kv_events=True)
    h = Harness(config, variant, num_blocks=32)
    h.add("a", prompt(8), max_new_tokens=10)
    h.settle()
    return h


def run(name: str, variant: str | Variant) -> Harness:
    try:
        fn = SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r} (known: {', '.join(SCENARIOS)})") from None
    return fn(variant)
