"""Table calls from many threads at once (each table has its own lock, the kernels run without the
GIL) end where the same calls made one after another end: every cell counted."""

import threading

import numpy as np
import pytest

from paramserver.server.shard import Shard, Step
from paramserver.tables.table_store import TableStore

TABLES, DIM, IDS, THREADS, PUSHES = 4, 8, 3000, 6, 40
SGD = {"name": "sgd", "hyper": {"lr": 0.5}}
ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.1, "initial_accumulator_value": 0.0}}
ZEROS = {"kind": "zeros"}


def plan(seed: int, disjoint: bool = False) -> list[list[tuple[str, np.ndarray, np.ndarray]]]:
    """Each thread's pushes: distinct ids (overlapping across threads and pushes; with `disjoint`,
    each thread's own ids) of every table, gradients of small whole numbers (sums and squares of
    them are exact in float32 in any order)."""
    rng = np.random.default_rng(seed)
    threads = []
    for number in range(THREADS):
        pushes = []
        for _ in range(PUSHES):
            name = f"t{rng.integers(TABLES)}"
            if disjoint:
                ids = rng.choice(IDS // THREADS, int(rng.integers(1, 200)), replace=False) * THREADS + number
            else:
                ids = rng.choice(IDS, int(rng.integers(1, 400)), replace=False)
            ids = ids.astype(np.int64)
            grads = rng.integers(-3, 4, (ids.shape[0], DIM)).astype(np.float32)
            pushes.append((name, ids, grads))
        threads.append(pushes)
    return threads


def new_store(optimizer: dict) -> TableStore:
    store = TableStore(0)
    for t in range(TABLES):
        store.register(f"t{t}", DIM, optimizer, ZEROS)
    return store


def run_threads(work, count: int) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def body(number: int) -> None:
        try:
            start.wait(10)
            work(number)
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,), name=f"pusher-{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a thread did not finish"
    if errors:
        raise errors[0]


def store_pushes(store: TableStore, pushes) -> None:
    for name, ids, grads in pushes:
        store.lookup(name, ids)  # rows created by lookups, from several threads at once
        store.apply_rows([[store.check_push(name, ids, grads)]])


def expected(threads, name: str, square: bool = False) -> np.ndarray:
    """Per id, the sum of its gradients (or of their squares) over every push, in any order."""
    total = np.zeros((IDS, DIM), np.float64)
    for pushes in threads:
        for table, ids, grads in pushes:
            if table == name:
                total[ids] += grads.astype(np.float64) ** 2 if square else grads
    return total


def by_id(store: TableStore, name: str, array: str = "values") -> np.ndarray:
    """The table's rows of `array`, at their ids (ids never touched: zeros)."""
    table = store.table(name)
    out = np.zeros((IDS, DIM), np.float32)
    out[table.row_ids[: table.size]] = table.array(array)[: table.size]
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_parallel_sgd_pushes_to_overlapping_ids_equal_the_serial_result_in_every_cell(seed):
    print("seed", seed)
    threads = plan(seed)
    parallel, serial = new_store(SGD), new_store(SGD)
    run_threads(lambda number: store_pushes(parallel, threads[number]), THREADS)
    for pushes in threads:
        store_pushes(serial, pushes)
    for t in range(TABLES):
        name = f"t{t}"
        reference = -0.5 * expected(threads, name)  # zeros, minus lr times every gradient of the id
        np.testing.assert_array_equal(by_id(parallel, name), reference.astype(np.float32), err_msg=name)
        np.testing.assert_array_equal(by_id(parallel, name), by_id(serial, name), err_msg=name)
        touched = np.unique(np.concatenate([ids for pushes in threads for n, ids, _ in pushes if n == name]))
        assert parallel.table(name).size == serial.table(name).size == touched.shape[0]
        assert parallel.table(name).steps == serial.table(name).steps  # every push counted


@pytest.mark.parametrize("seed", [2])
def test_parallel_adagrad_pushes_equal_the_serial_result_in_every_cell(seed):
    """Threads push to the same tables at once, each to its own ids (Adagrad's result depends on the
    order of a row's updates: each row's order is then its thread's): values and accumulators equal
    a serial run's in every cell, and each accumulator is the sum of its squared gradients."""
    print("seed", seed)
    threads = plan(seed, disjoint=True)
    parallel, serial = new_store(ADAGRAD), new_store(ADAGRAD)
    run_threads(lambda number: store_pushes(parallel, threads[number]), THREADS)
    for pushes in threads:
        store_pushes(serial, pushes)
    for t in range(TABLES):
        name = f"t{t}"
        reference = expected(threads, name, square=True).astype(np.float32)
        np.testing.assert_array_equal(by_id(parallel, name, "sum"), reference, err_msg=name)
        np.testing.assert_array_equal(by_id(parallel, name, "sum"), by_id(serial, name, "sum"), err_msg=name)
        np.testing.assert_array_equal(by_id(parallel, name), by_id(serial, name), err_msg=name)
        assert np.count_nonzero(by_id(parallel, name)) > 0


def test_parallel_shard_steps_equal_the_serial_result_and_a_checkpoint_cut_falls_between_steps():
    """Async steps through the Shard (rows applied outside its lock) from many threads, with
    checkpoint cuts taken meanwhile: the final rows are the serial result in every cell, and each
    cut saw whole steps only (every table holds the same number of updates: each step pushes to all)."""
    seed = 3
    print("seed", seed)
    rng = np.random.default_rng(seed)
    shard = Shard(0)
    for t in range(TABLES):
        shard.tables.register(f"t{t}", DIM, SGD, ZEROS)
        shard.tables.lookup(f"t{t}", np.arange(IDS, dtype=np.int64))  # a push to an id without a row is dropped
    steps = [
        [
            Step(
                grads={},
                pull=[],
                row_pushes=[
                    (f"t{t}", ids := rng.choice(IDS, 200, replace=False).astype(np.int64),
                     rng.integers(-3, 4, (ids.shape[0], DIM)).astype(np.float32))
                    for t in range(TABLES)
                ],
                lookups=[(f"t{t}", rng.choice(IDS, 100, replace=False).astype(np.int64)) for t in range(TABLES)],
            )
            for _ in range(PUSHES)
        ]
        for _ in range(THREADS)
    ]  # fmt: skip
    cuts: list[list[int]] = []
    done = threading.Event()

    def cut() -> list[int]:
        def read(groups, version, sync_step):
            taken = shard.tables.begin_snapshot()
            return [meta["steps"] for meta, _ in taken.values()]

        try:
            return shard.snapshot(read)
        finally:
            shard.tables.end_snapshot()

    def work(number: int) -> None:
        if number == THREADS:
            while not done.is_set():
                cuts.append(cut())
            return
        for step in steps[number]:
            shard.step(step, lambda outcome, values, rows: None)

    def run(number: int) -> None:
        try:
            work(number)
        finally:
            if number == 0:
                done.set()

    run_threads(run, THREADS + 1)
    assert cuts, "no checkpoint cut was taken"
    for steps_seen in cuts:
        assert len(set(steps_seen)) == 1, f"a cut between a step's tables: {steps_seen}"
    for t in range(TABLES):
        name = f"t{t}"
        total = np.zeros((IDS, DIM), np.float64)
        for thread in steps:
            for step in thread:
                _, ids, grads = step.row_pushes[t]
                total[ids] += grads
        np.testing.assert_array_equal(by_id(shard.tables, name), (-0.5 * total).astype(np.float32), err_msg=name)
        assert shard.tables.table(name).steps == THREADS * PUSHES
