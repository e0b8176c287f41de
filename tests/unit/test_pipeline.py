"""The row pipeline: a plain loop gets each next batch's embedding rows with the current step."""

import pytest
import torch
import torch.nn.functional as F
from test_hash_embedding import record_calls

import paramserver as ps
from paramserver.worker import current as context_module

VOCAB, DIM, STEPS = 50, 4, 10


class TwoTables(torch.nn.Module):
    """Two tables fed by two elements of the batch; `sliced` feeds the second a computed tensor."""

    def __init__(self, sliced: bool = False):
        super().__init__()
        self.user = ps.nn.HashEmbedding(DIM, std=0.1, name="user")
        self.item = ps.nn.HashEmbeddingBag(DIM, mode="sum", std=0.1, name="item")
        torch.manual_seed(0)
        self.head = torch.nn.Linear(2 * DIM, 1)
        self.sliced = sliced

    def forward(self, users, items):
        items = items[:, :2] if self.sliced else items
        return self.head(torch.cat([self.user(users), self.item(items)], dim=1)).squeeze(1)


def batches(steps=STEPS, as_dict=False):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        users, items = torch.randint(0, VOCAB, (8,), generator=g), torch.randint(0, VOCAB, (8, 3), generator=g)
        target = torch.randn(8, generator=g)
        out.append({"users": users, "items": items, "y": target} if as_dict else (users, items, target))
    return out


def train(loop: str, overlap: bool = False, sliced: bool = False, as_dict: bool = False):
    """Train STEPS batches with one of the loops; (final rows and head, methods called from batch 2 on).

    "hand": the loop users wrote before the pipeline, prefetching the batch the next reply serves
    after the forward (as examples/ctr.py did), over data pipelined too ("hand+plain") or not."""
    ctx = ps.init(num_ps=2)
    model = TwoTables(sliced)
    opt = ps.optim.Adam(model.named_parameters(), lr=0.05, overlap=overlap)
    data = batches(as_dict=as_dict)
    methods = record_calls(ctx)
    source = {"plain": lambda: ctx.resumable(data), "hand+plain": lambda: ctx.resumable(data),
              "pipeline": lambda: ps.pipeline(data),
              "unpipelined": lambda: ctx.resumable(data, prefetch_rows=False),
              "hand": lambda: ctx.resumable(data, prefetch_rows=False)}[loop]()
    later, ahead = None, 2 if overlap else 1
    for step, batch in enumerate(source):
        users, items, y = (batch["users"], batch["items"], batch["y"]) if as_dict else batch
        if step == 2:
            later = len(methods)
        opt.zero_grad()
        loss = F.mse_loss(model(users, items), y)
        if loop.startswith("hand") and step + ahead < len(data):
            model.user.prefetch(data[step + ahead][0])
            model.item.prefetch(data[step + ahead][1])
        loss.backward()
        opt.step()
    opt.synchronize()
    called = methods[later:]
    result = torch.cat([model.user.lookup(torch.arange(VOCAB)).detach().flatten(),
                        model.item.lookup(torch.arange(VOCAB)).detach().flatten(), model.head.weight.detach().flatten()])
    context_module.current_context().shutdown()
    return result, called


@pytest.mark.parametrize("overlap", [False, True], ids=["exact", "overlap"])
def test_a_plain_loop_fetches_no_rows_at_its_forwards_and_trains_exactly_as_without(overlap, fresh_context):
    plain, called = train("plain", overlap)
    unpipelined, called_unpipelined = train("unpipelined", overlap)
    if not overlap:  # exact: the rows are read after the step's update, as a lookup at the forward reads them
        torch.testing.assert_close(plain, unpipelined, rtol=0, atol=0)
    else:  # rows that ride an overlapped step miss the update of the step in between (docs/embeddings.md)
        torch.testing.assert_close(plain, unpipelined, rtol=0, atol=0.1)
    assert "Lookup" in called_unpipelined  # without the pipeline each forward looks its rows up
    assert "Lookup" not in called and called.count("PushPull") == 2 * (STEPS - 2)  # one request per shard and step
    for loop in ("hand", "hand+plain"):  # the loop written by hand: the same rows, the same requests
        hand, called_by_hand = train(loop, overlap)
        torch.testing.assert_close(hand, plain, rtol=0, atol=0)
        assert called_by_hand == called, loop


def test_the_pipeline_wrapper_without_resumption_and_dict_batches(fresh_context):
    piped, called = train("pipeline", as_dict=True)
    unpipelined, _ = train("unpipelined", as_dict=True)
    torch.testing.assert_close(piped, unpipelined, rtol=0, atol=0)
    assert "Lookup" not in called


def test_a_table_given_a_computed_tensor_is_looked_up_at_its_forward(fresh_context, caplog):
    with caplog.at_level("INFO", logger="paramserver.worker.pipeline"):
        plain, called = train("plain", sliced=True)
    unpipelined, _ = train("unpipelined", sliced=True)
    torch.testing.assert_close(plain, unpipelined, rtol=0, atol=0)
    assert called.count("Lookup") == 2 * (STEPS - 2)  # the item table, on both shards, every step
    assert "table item: its ids are not an element of the batch" in caplog.text


def test_an_evaluation_forward_inside_the_loop_asks_for_nothing(fresh_context):
    ctx = ps.init(num_ps=1)
    model = TwoTables()
    opt = ps.optim.SGD(model.parameters(), lr=0.1)
    data = batches(4)
    pipeline = ps.pipeline(data)
    for users, items, y in pipeline:
        opt.zero_grad()
        F.mse_loss(model(users, items), y).backward()
        with torch.no_grad():
            model(users, items)  # an evaluation: not a training forward
        opt.step()
    assert pipeline.prefetched == 2 * 3  # two tables, for the batches after the first three
    ctx.shutdown()


def test_trainer_fit_is_pipelined(fresh_context):
    ctx = ps.init(num_ps=2)
    table = ps.nn.HashEmbedding(DIM, std=0.1)
    model = torch.nn.Sequential(table, torch.nn.Flatten(), torch.nn.Linear(3 * DIM, 1), torch.nn.Flatten(0))
    opt = ps.optim.SGD(model.parameters(), lr=0.1)
    data = [(users.view(-1, 1).repeat(1, 3), y) for users, _, y in batches()]
    methods = record_calls(ctx)
    ps.Trainer(model, opt, F.mse_loss, verbose=False).fit(data)
    assert methods.count("Lookup") == 2  # the first batch only (on both shards)
    ctx.shutdown()


def test_an_exact_step_reads_the_next_batch_while_it_waits_for_the_ps(fresh_context):
    ctx = ps.init(num_ps=1)
    model = TwoTables()
    opt = ps.optim.SGD(model.parameters(), lr=0.1)
    events = record_calls(ctx)
    settle = opt._settle
    opt._settle = lambda *args: (events.append("reply"), settle(*args))

    def reading(data):
        for index, batch in enumerate(data):
            events.append(f"read {index}")
            yield batch
    for users, items, y in ctx.resumable(reading(batches(4))):
        opt.zero_grad()
        F.mse_loss(model(users, items), y).backward()
        opt.step()
    trained = [e for e in events if e != "Lookup"]
    # batches 0 and 1 before the first step, then each next one between a step's request and its reply
    assert trained[:6] == ["read 0", "read 1", "PushPull", "read 2", "reply", "PushPull"], trained
    assert trained[6:8] == ["read 3", "reply"], trained


def test_a_loader_error_raised_while_a_step_waits_comes_out_of_the_loop(fresh_context):
    ctx = ps.init(num_ps=1)
    model = TwoTables()
    opt = ps.optim.SGD(model.parameters(), lr=0.1)

    def failing():
        yield from batches(2)
        raise OSError("disk gone")
    trained = 0
    with pytest.raises(OSError, match="disk gone"):
        for users, items, y in ctx.pipeline(failing()):
            opt.zero_grad()
            F.mse_loss(model(users, items), y).backward()
            opt.step()  # the read during this step's wait fails: the step itself succeeds
            trained += 1
    assert trained == 1 and opt.while_waiting is None
