"""TensorFlow reference: ParameterServerStrategy training the CTR model of examples/ctr.py.

Measures, on the same data and model shape as examples/ctr.py, how many examples/s TensorFlow's
own parameter-server training reaches, so that paramserver's figures (bench/embedding.py, case
"ctr") can be set beside TensorFlow's measured on the same machine, back to back.

What runs, for each topology (PS tasks x worker tasks):
- one `tf.distribute.Server` process per PS task and per worker task, plus a chief process that
  builds `tf.distribute.ParameterServerStrategy` and a `ClusterCoordinator`, all on 127.0.0.1;
- data: Criteo TSV lines (examples/ctr_data.py) read with tf.data on each worker; a worker keeps
  every num_workers-th line of the file (`Dataset.shard`), as examples/ctr.py does. Dense
  features are log(1 + max(x, 0)) with missing as 0; each categorical value is salted with its
  column and hashed (`tf.strings.to_hash_bucket_fast`) into one shared table of 1,000,000 rows;
- model: that 1,000,000 x 16 table, split across the PS tasks (FixedShardsPartitioner), then an
  MLP 429-256-128-1 over the 13 dense features and the 26 embeddings; sigmoid cross-entropy;
  Adam (lr 1e-3), lazy for the table (only the rows of the batch are updated, as torch's
  SparseAdam and paramserver do), TensorFlow's ResourceApplyAdam kernel for the rest; every
  update runs on the PS that holds the variable; batches of 512; asynchronous training;
- a plain training loop over tf.Variable and tf.function (no Keras); each scheduled function
  runs `--steps-per-call` steps.

Examples/s are counted over all workers after a warm-up (the first ~10% of the steps, which
include tracing); peak RSS is sampled every 0.2 s per process and the maximum of each kind is
reported. After training, the chief reports the AUC on the test file. One JSON line per topology.

TensorFlow lives in its own virtual environment, apart from the project's:

    python3 -m venv /tmp/tfvenv
    /tmp/tfvenv/bin/pip install 'tensorflow==2.21.*' numpy psutil
    python examples/ctr_data.py --rows 200000 --out /tmp/tfref/train.tsv --seed 1
    python examples/ctr_data.py --rows 20000 --out /tmp/tfref/test.tsv --seed 2
    /tmp/tfvenv/bin/python bench/tf_reference.py --train /tmp/tfref/train.tsv --test /tmp/tfref/test.tsv

Each worker task runs in a directory of its own holding a file `shard` with its index: the
per-worker dataset function is one graph for all workers, and it reads that file to pick its
part of the data.

`--model dense` runs bench/dense.py's case instead (no data files): the seed MLP 784-1024-512-10
(ReLU, softmax cross-entropy, ResourceApplyAdam lr 1e-3 on the PS for every variable), batches of
64 per worker drawn from 16 fixed random batches, as bench/dense.py's workers do; after a warm-up
of 2 calls per worker, calls are scheduled `--seconds` long and the examples/s of all workers
together are reported:

    /tmp/tfvenv/bin/python bench/tf_reference.py --model dense --batch-size 64 --seconds 10
"""

import argparse
import functools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

try:
    import psutil
except ImportError:
    psutil = None

NUM_DENSE, NUM_SPARSE, DIM, BUCKETS = 13, 26, 16, 1_000_000
HIDDEN = (256, 128)
BETA1, BETA2, EPSILON = 0.9, 0.999, 1e-8
WARMUP_FRACTION = 0.1


# ---------------------------------------------------------------------------------------------
# Launcher: starts the processes of one topology, samples their memory, collects the result.


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cluster_spec(num_ps: int, num_workers: int) -> dict:
    def addresses(count):
        return [f"127.0.0.1:{free_port()}" for _ in range(count)]

    return {"chief": addresses(1), "ps": addresses(num_ps), "worker": addresses(num_workers)}


class RssSampler(threading.Thread):
    """Peak resident memory (MB) of each kind of process, sampled every 0.2 s."""

    def __init__(self, kinds: dict) -> None:
        super().__init__(daemon=True)
        self.processes = {kind: [psutil.Process(pid) for pid in pids] for kind, pids in kinds.items()}
        self.peak = {kind: 0.0 for kind in kinds}
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.2):
            for kind, processes in self.processes.items():
                for process in processes:
                    try:
                        self.peak[kind] = max(self.peak[kind], process.memory_info().rss / 2**20)
                    except psutil.Error:  # the process has ended
                        pass

    def stop(self) -> dict:
        self.stopped.set()
        self.join()
        return {kind: round(peak, 1) for kind, peak in self.peak.items()}


def start(role: str, index: int, spec: dict, args, workdir: Path) -> subprocess.Popen:
    """A process of the cluster; its output goes to ROLEINDEX.log in workdir (the chief's result line to a pipe)."""
    log_name = f"{role}{index}.log"
    with open(workdir / log_name, "w") as log:
        process = launch(role, index, spec, args, workdir, log)
    process.log_name = log_name
    return process


def launch(role: str, index: int, spec: dict, args, workdir: Path, log) -> subprocess.Popen:
    command = [sys.executable, os.path.abspath(__file__), "--role", role, "--index", str(index),
               "--cluster", json.dumps(spec), "--intra-op", str(args.intra_op), "--inter-op", str(args.inter_op)]
    if role == "chief":
        command += ["--model", args.model, "--batch-size", str(args.batch_size),
                    "--steps-per-call", str(args.steps_per_call), "--lr", str(args.lr), "--seconds", str(args.seconds)]
        if args.model == "ctr":
            command += ["--train", os.path.abspath(args.train), "--test", os.path.abspath(args.test)]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
    cwd = workdir / f"{role}{index}"
    cwd.mkdir()
    (cwd / "shard").write_text(str(index))
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)


def stop_all(processes: list) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_topology(num_ps: int, num_workers: int, args) -> dict:
    spec = cluster_spec(num_ps, num_workers)
    with tempfile.TemporaryDirectory(prefix="tf_reference_") as tmp:
        workdir, processes = Path(tmp), []
        try:
            servers = {kind: [start(kind, i, spec, args, workdir) for i in range(len(spec[kind]))]
                       for kind in ("ps", "worker")}
            processes += servers["ps"] + servers["worker"]
            chief = start("chief", 0, spec, args, workdir)
            processes.append(chief)
            sampler = RssSampler({kind: [p.pid for p in procs] for kind, procs in
                                  {**servers, "chief": [chief]}.items()})
            sampler.start()
            failure = wait_for_chief(chief, processes, args.timeout)
            peak_rss = sampler.stop()
            if failure:
                log_name, what = failure
                raise SystemExit(f"{num_ps} PS x {num_workers} workers: {what}; end of {log_name}:\n"
                                 f"{tail(workdir / log_name)}")
            output = chief.stdout.read()
        finally:
            stop_all(processes)
    result = json.loads(output.strip().splitlines()[-1])
    return {"bench": "tf_reference", "case": args.model, "ps": num_ps, "workers": num_workers,
            "batch_size": args.batch_size, **result, "peak_rss_mb": peak_rss}


def wait_for_chief(chief: subprocess.Popen, processes: list, timeout: float):
    """None once the chief has succeeded; else (log file of the process at fault, what happened)."""
    deadline = time.monotonic() + timeout
    while chief.poll() is None:
        ended = [p for p in processes if p is not chief and p.poll() is not None]
        if ended:
            return ended[0].log_name, f"a server ended (code {ended[0].returncode}) before the chief"
        if time.monotonic() > deadline:
            return chief.log_name, f"no result after {timeout:.0f} s"
        time.sleep(0.5)
    return (chief.log_name, f"the chief failed (code {chief.returncode})") if chief.returncode else None


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def topologies(text: str) -> list:
    pairs = []
    for item in text.split(","):
        num_ps, _, num_workers = item.strip().partition("x")
        pairs.append((int(num_ps), int(num_workers)))
    return pairs


# ---------------------------------------------------------------------------------------------
# Servers: a PS or worker task.


def session_config(args):
    import tensorflow as tf

    return tf.compat.v1.ConfigProto(intra_op_parallelism_threads=args.intra_op,
                                    inter_op_parallelism_threads=args.inter_op)


def serve(args) -> None:
    import tensorflow as tf

    spec = tf.train.ClusterSpec(json.loads(args.cluster))
    server = tf.distribute.Server(spec, job_name=args.role, task_index=args.index, protocol="grpc",
                                  config=session_config(args), start=True)
    server.join()


# ---------------------------------------------------------------------------------------------
# Training: data, model, optimizer and loop, built by the chief and run by the workers; evaluation.


def parse_batch(lines):
    """A batch of TSV lines -> (dense float32 (B, 13), ids int64 (B, 26), labels float32 (B,))."""
    import tensorflow as tf

    defaults = [tf.constant([0], tf.int64)] * (1 + NUM_DENSE) + [tf.constant([""])] * NUM_SPARSE
    fields = tf.io.decode_csv(lines, record_defaults=defaults, field_delim="\t", na_value="")
    dense = tf.stack([tf.cast(f, tf.float32) for f in fields[1:1 + NUM_DENSE]], axis=1)
    dense = tf.math.log1p(tf.maximum(dense, 0.0))
    values = tf.stack(fields[1 + NUM_DENSE:], axis=1)
    salts = tf.broadcast_to(tf.constant([f"{i}:" for i in range(NUM_SPARSE)]), tf.shape(values))
    ids = tf.strings.to_hash_bucket_fast(tf.strings.join([salts, values]), BUCKETS)
    return dense, ids, tf.cast(fields[0], tf.float32)


def train_dataset(path: str, num_workers: int, batch_size: int):
    """This worker's lines (every num_workers-th, from its index), repeated, in parsed batches."""
    import tensorflow as tf

    index = tf.strings.to_number(tf.io.read_file("shard"), tf.int64)
    lines = tf.data.TextLineDataset(path).shard(num_workers, index).repeat()
    batches = lines.batch(batch_size, drop_remainder=True).map(parse_batch, num_parallel_calls=tf.data.AUTOTUNE)
    return batches.map(lambda d, i, y: (d, i, y, index)).prefetch(tf.data.AUTOTUNE)


def normal_init(shape, dtype, stddev, partition_shape=None, partition_offset=None):
    import tensorflow as tf

    return tf.random.normal(partition_shape or shape, stddev=stddev, dtype=dtype)


def uniform_init(shape, dtype, bound, partition_shape=None, partition_offset=None):
    import tensorflow as tf

    return tf.random.uniform(partition_shape or shape, -bound, bound, dtype=dtype)


class CTRModel:
    """The shared table and the MLP, as in examples/ctr.py (torch's default Linear initialization)."""

    def __init__(self, strategy) -> None:
        import tensorflow as tf

        def variable(init, shape, name, **kw):
            return tf.Variable(functools.partial(init, shape=shape, dtype=tf.float32, **kw), shape=shape,
                               dtype=tf.float32, name=name)

        with strategy.scope():
            self.table = variable(normal_init, (BUCKETS, DIM), "table", stddev=0.01)
            self.layers, width = [], NUM_DENSE + NUM_SPARSE * DIM
            for n, out in enumerate(HIDDEN + (1,)):
                bound = 1 / math.sqrt(width)
                self.layers.append((variable(uniform_init, (width, out), f"w{n}", bound=bound),
                                    variable(uniform_init, (out,), f"b{n}", bound=bound)))
                width = out

    def dense_variables(self) -> list:
        return [v for layer in self.layers for v in layer]

    def __call__(self, dense, ids):
        import tensorflow as tf

        distinct, position = tf.unique(tf.reshape(ids, [-1]))  # each distinct row fetched once
        embedded = tf.gather(tf.nn.embedding_lookup(self.table, distinct), position)
        x = tf.concat([dense, tf.reshape(embedded, [-1, NUM_SPARSE * DIM])], axis=1)
        for n, (w, b) in enumerate(self.layers):
            x = tf.matmul(x, w) + b
            if n < len(self.layers) - 1:
                x = tf.nn.relu(x)
        return tf.squeeze(x, 1)


def shards(variable) -> list:
    return list(getattr(variable, "variables", [variable]))


class Adam:
    """Adam with slots beside each variable shard; row-wise (lazy) for the embedding table's shards."""

    def __init__(self, strategy, model, lr: float) -> None:
        import tensorflow as tf

        self.lr = lr
        self.sparse = shards(model.table) if hasattr(model, "table") else []
        self.dense = [s for v in model.dense_variables() for s in shards(v)]
        self.slots = {}
        with strategy.scope():
            self.step = tf.Variable(0, dtype=tf.int64, name="step")
            for shard in self.sparse + self.dense:
                with strategy.extended.colocate_vars_with(shard):
                    self.slots[shard.ref()] = tuple(
                        tf.Variable(functools.partial(tf.zeros, shard.shape), name=name) for name in ("m", "v"))

    def variables(self) -> list:
        return self.sparse + self.dense

    def apply(self, grads) -> None:
        import tensorflow as tf

        t = tf.cast(self.step.assign_add(1), tf.float32)
        lr = self.lr * tf.sqrt(1 - BETA2 ** t) / (1 - BETA1 ** t)
        for shard, grad in zip(self.variables(), grads):
            m, v = self.slots[shard.ref()]
            if isinstance(grad, tf.IndexedSlices):
                rows, position = tf.unique(grad.indices)
                summed = tf.math.unsorted_segment_sum(grad.values, position, tf.shape(rows)[0])
                with tf.device(shard.device):
                    self.apply_rows(shard, m, v, rows, summed, lr)
            else:
                with tf.device(shard.device):
                    tf.raw_ops.ResourceApplyAdam(var=shard.handle, m=m.handle, v=v.handle,
                                                 beta1_power=BETA1 ** t, beta2_power=BETA2 ** t, lr=self.lr,
                                                 beta1=BETA1, beta2=BETA2, epsilon=EPSILON, grad=grad)

    @staticmethod
    def apply_rows(shard, m, v, rows, grad, lr) -> None:
        import tensorflow as tf

        m_rows = BETA1 * tf.gather(m, rows) + (1 - BETA1) * grad
        v_rows = BETA2 * tf.gather(v, rows) + (1 - BETA2) * tf.square(grad)
        m.scatter_update(tf.IndexedSlices(m_rows, rows))
        v.scatter_update(tf.IndexedSlices(v_rows, rows))
        shard.scatter_sub(tf.IndexedSlices(lr * m_rows / (tf.sqrt(v_rows) + EPSILON), rows))


def make_train_function(strategy, model: CTRModel, optimizer: Adam, steps_per_call: int):
    import tensorflow as tf

    def step(dense, ids, labels):
        with tf.GradientTape() as tape:
            logits = model(dense, ids)
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))
        optimizer.apply(tape.gradient(loss, optimizer.variables()))
        return loss

    @tf.function
    def train(iterator):
        loss, index = tf.constant(0.0), tf.constant(-1, tf.int64)
        for _ in tf.range(steps_per_call):
            dense, ids, labels, index = next(iterator)
            loss = strategy.run(step, args=(dense, ids, labels))
        return loss, index

    return train


def roc_auc(labels, scores) -> float:
    """Area under the ROC curve (ties share their mean rank)."""
    import numpy as np

    labels, scores = np.asarray(labels).astype(bool), np.asarray(scores, np.float64)
    positives, negatives = int(labels.sum()), int((~labels).sum())
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    mean_rank = np.cumsum(counts) - (counts - 1) / 2.0
    rank_sum = mean_rank[inverse][labels].sum()
    return float((rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives))


def evaluate(model: CTRModel, path: str) -> float:
    import numpy as np
    import tensorflow as tf

    predict = tf.function(lambda dense, ids: tf.sigmoid(model(dense, ids)))
    scores, labels = [], []
    for dense, ids, y in tf.data.TextLineDataset(path).batch(4096).map(parse_batch):
        scores.append(predict(dense, ids).numpy())
        labels.append(y.numpy())
    return roc_auc(np.concatenate(labels), np.concatenate(scores))


def count_lines(path: str) -> int:
    with open(path, "rb") as handle:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 20), b""))


def call_counts(lines: int, examples_per_call: int, num_workers: int) -> tuple:
    """(warm-up calls, timed calls) for one pass over the lines, each a multiple of num_workers."""
    calls = lines // examples_per_call
    warmup = num_workers * max(1, round(calls * WARMUP_FRACTION / num_workers))
    timed = num_workers * max(1, (calls - warmup) // num_workers)
    return warmup, timed


def timed_schedule(coordinator, train, iterator, calls: int, shards_seen: set) -> float:
    """Schedules `calls` calls, waits for them all; returns the seconds taken."""
    started = time.perf_counter()
    results = [coordinator.schedule(train, args=(iterator,)) for _ in range(calls)]
    coordinator.join()
    seconds = time.perf_counter() - started
    for result in results:
        shards_seen.add(int(result.fetch()[1]))
    return seconds


class DenseModel:
    """bench/dense.py's seed MLP 784-1024-512-10 (torch's default Linear initialization)."""

    def __init__(self, strategy) -> None:
        import tensorflow as tf

        self.layers, width = [], 784
        with strategy.scope():
            for n, out in enumerate((1024, 512, 10)):
                bound = 1 / math.sqrt(width)
                self.layers.append(tuple(
                    tf.Variable(functools.partial(uniform_init, shape=shape, dtype=tf.float32, bound=bound),
                                shape=shape, dtype=tf.float32, name=f"{kind}{n}")
                    for kind, shape in (("w", (width, out)), ("b", (out,)))))
                width = out

    def dense_variables(self) -> list:
        return [v for layer in self.layers for v in layer]

    def __call__(self, x):
        import tensorflow as tf

        for n, (w, b) in enumerate(self.layers):
            x = tf.matmul(x, w) + b
            if n < len(self.layers) - 1:
                x = tf.nn.relu(x)
        return x


def dense_dataset(batch_size: int):
    """16 fixed random batches of this worker (seeded by its index), repeated."""
    import tensorflow as tf

    index = tf.strings.to_number(tf.io.read_file("shard"), tf.int64)
    x = tf.random.stateless_normal((16, batch_size, 784), seed=tf.stack([index, 0]))
    y = tf.random.stateless_uniform((16, batch_size), seed=tf.stack([index, 1]), maxval=10, dtype=tf.int64)
    return tf.data.Dataset.from_tensor_slices((x, y)).map(lambda a, b: (a, b, index)).repeat().prefetch(4)


def dense_chief(args, strategy, coordinator, num_workers: int) -> None:
    import tensorflow as tf

    model = DenseModel(strategy)
    optimizer = Adam(strategy, model, args.lr)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=model(x)))
        optimizer.apply(tape.gradient(loss, optimizer.variables()))
        return loss

    @tf.function
    def train(iterator):
        loss, index = tf.constant(0.0), tf.constant(-1, tf.int64)
        for _ in tf.range(args.steps_per_call):
            x, y, index = next(iterator)
            loss = strategy.run(step, args=(x, y))
        return loss, index

    iterator = iter(coordinator.create_per_worker_dataset(lambda: dense_dataset(args.batch_size)))
    shards_seen = set()
    timed_schedule(coordinator, train, iterator, 2 * num_workers, shards_seen)  # warm-up, tracing
    calls, seconds = 0, 0.0
    while seconds < args.seconds:  # rounds of 2 calls per worker until --seconds have passed
        seconds += timed_schedule(coordinator, train, iterator, 2 * num_workers, shards_seen)
        calls += 2 * num_workers
    if shards_seen != set(range(num_workers)):
        raise SystemExit(f"expected the workers' shards {list(range(num_workers))}, saw {sorted(shards_seen)}")
    print(json.dumps({
        "examples_per_s": round(calls * args.steps_per_call * args.batch_size / seconds, 1),
        "timed_steps": calls * args.steps_per_call, "steps_per_call": args.steps_per_call,
        "seconds": round(seconds, 2), "threads": {"intra_op": args.intra_op, "inter_op": args.inter_op},
        "tensorflow": tf.__version__}), flush=True)


def chief(args) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.intra_op)
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op)
    spec = json.loads(args.cluster)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")
    num_ps, num_workers = len(spec["ps"]), len(spec["worker"])
    strategy = tf.distribute.ParameterServerStrategy(
        resolver, variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(num_ps))
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    if args.model == "dense":
        return dense_chief(args, strategy, coordinator, num_workers)
    model = CTRModel(strategy)
    optimizer = Adam(strategy, model, args.lr)
    train = make_train_function(strategy, model, optimizer, args.steps_per_call)
    dataset = coordinator.create_per_worker_dataset(
        lambda: train_dataset(args.train, num_workers, args.batch_size))
    iterator = iter(dataset)

    warmup, timed = call_counts(count_lines(args.train), args.batch_size * args.steps_per_call, num_workers)
    shards_seen = set()
    timed_schedule(coordinator, train, iterator, warmup, shards_seen)
    seconds = timed_schedule(coordinator, train, iterator, timed, shards_seen)
    if shards_seen != set(range(num_workers)):
        raise SystemExit(f"expected the workers' shards {list(range(num_workers))}, saw {sorted(shards_seen)}")
    examples = timed * args.steps_per_call * args.batch_size
    print(json.dumps({
        "examples_per_s": round(examples / seconds, 1), "steps": (warmup + timed) * args.steps_per_call,
        "timed_steps": timed * args.steps_per_call, "steps_per_call": args.steps_per_call,
        "threads": {"intra_op": args.intra_op, "inter_op": args.inter_op},
        "test_auc": round(evaluate(model, args.test), 4), "tensorflow": tf.__version__}), flush=True)


# ---------------------------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("ctr", "dense"), default="ctr",
                        help="ctr: examples/ctr.py's model; dense: bench/dense.py's seed MLP (synthetic data)")
    parser.add_argument("--seconds", type=float, default=10.0, help="timed seconds (--model dense)")
    parser.add_argument("--train", help="training lines (examples/ctr_data.py)")
    parser.add_argument("--test", help="held-out lines for the AUC")
    parser.add_argument("--topologies", default="1x1,2x2", help="PSxWORKERS, comma separated")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps-per-call", type=int, default=16, help="training steps in one scheduled function")
    parser.add_argument("--intra-op", type=int, default=1, help="intra-op threads of every process")
    parser.add_argument("--inter-op", type=int, default=2, help="inter-op threads of every process")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds to wait for one topology's result")
    parser.add_argument("--role", choices=("ps", "worker", "chief"), help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role in (None, "chief") and args.model == "ctr" and not (args.train and args.test):
        parser.error("--train and --test are required")
    for path in (args.train, args.test) if args.role is None and args.model == "ctr" else ():
        if not os.path.isfile(path):
            parser.error(f"no such file: {path}")
    return args


def require_tensorflow() -> None:
    check = subprocess.run([sys.executable, "-c", "import tensorflow"], capture_output=True, text=True)
    if check.returncode != 0:
        reason = (check.stderr.strip().splitlines() or ["unknown error"])[-1]
        raise SystemExit(f"TensorFlow is not importable in {sys.executable} ({reason}); install it in a venv of "
                         "its own: python3 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install "
                         "'tensorflow==2.21.*' numpy psutil, then run this with /tmp/tfvenv/bin/python")


def main() -> None:
    args = parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.role in ("ps", "worker"):
        serve(args)
    elif args.role == "chief":
        chief(args)
    else:
        require_tensorflow()
        if psutil is None:
            raise SystemExit(f"psutil is not importable in {sys.executable}: pip install psutil")
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the processes started are stopped
        for num_ps, num_workers in topologies(args.topologies):
            print(json.dumps(run_topology(num_ps, num_workers, args)), flush=True)


if __name__ == "__main__":
    main()
