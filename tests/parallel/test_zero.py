"""tandem.parallel.ZeroAdagrad on spawned Gloo ranks (2 and 3, 127.0.0.1, file store), against
single-process torch.optim.Adagrad on the concatenated batch; plus the shard layout, in process.

One process group per world size runs every check; every wait is bounded and every process is killed
at the end, whatever happened.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any

import _zero_workers as w
import pytest
import torch
from _ranks import spawn_ranks

from tandem.parallel import ZeroAdagrad
from tandem.parallel.zero import shard_layout

# float64 end to end: the averaged gradients differ from the full batch's in the order of the sums, and
# the fused update from torch's in the last bit of some elements.
TIGHT = dict(rtol=1e-11, atol=1e-13)
TOTAL = sum(p.numel() for p in w.model().parameters())


def run_group(tmp: Path, world: int, timeout_s: float) -> list[dict[str, Any]]:
    saved = spawn_ranks(w.entry, lambda r: (r, world, str(tmp / "store"), str(tmp)), world, tmp, timeout_s)
    results = []
    for r, res in enumerate(saved):
        assert res is not None, f"rank {r} of {world} left no result (crashed or timed out)"
        assert "fatal" not in res, f"rank {r}: {res['fatal']}"
        results.append(res)
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def group(request, tmp_path_factory) -> tuple[int, list[dict[str, Any]]]:
    world = request.param
    return world, run_group(tmp_path_factory.mktemp(f"zero-{world}"), world, timeout_s=120)


def check(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    per_rank = [res[name] for res in results]
    for r, res in enumerate(per_rank):
        assert "error" not in res or not str(res["error"]).startswith("Traceback"), (
            f"rank {r}, check {name!r}:\n{res['error']}"
        )
    return per_rank


def assert_params(got: list[torch.Tensor], want: list[torch.Tensor], **tol) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, msg=lambda m, i=i: f"parameter {i}: {m}", **tol)


@pytest.mark.timeout(150)
def test_equals_single_process_adagrad(group):
    world, results = group
    want = w.params(w.reference(world, range(w.STEPS))[0])
    per_rank = check(results, "train")
    for res in per_rank:
        assert_params(res["params"], want, **TIGHT)
        assert res["steps"] == [float(w.STEPS)] * len(want)
    for res in per_rank[1:]:  # the broadcasts leave every rank with the same bits
        assert_params(res["params"], per_rank[0]["params"], rtol=0, atol=0)


def test_each_rank_holds_its_share_of_the_state(group):
    world, results = group
    sizes = [res["state_numel"] for res in check(results, "train")]
    assert sum(sizes) == TOTAL
    assert set(sizes) <= {TOTAL // world, -(-TOTAL // world)}  # 107 elements: 53/54 or 35/36
    for res in check(results, "train"):
        assert len(res["storages"] - {0}) <= 1  # one flat shard per dtype, the state's sums view it


def test_consolidated_state_is_torch_adagrads(group):
    world, results = group
    per_rank = check(results, "train")
    ref_model, ref_opt = w.reference(world, range(w.STEPS))
    want = ref_opt.state_dict()
    got = per_rank[world - 1]["consolidated"]
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]]
    for g_got, g_want in zip(got["param_groups"], want["param_groups"]):
        assert {k: v for k, v in g_got.items() if k != "params"} == {
            k: v for k, v in g_want.items() if k != "params"
        }
    assert sorted(got["state"]) == sorted(want["state"])
    for k in want["state"]:
        torch.testing.assert_close(got["state"][k]["sum"], want["state"][k]["sum"], **TIGHT)
        assert float(got["state"][k]["step"]) == float(want["state"][k]["step"])
    # Loaded into torch.optim.Adagrad, training goes on as it does with ZeroAdagrad on the ranks.
    continued = per_rank[world - 1]["torch_continued"]
    for res in per_rank:
        assert_params(res["zero_continued"], continued, **TIGHT)
    w.train(ref_model, ref_opt, range(w.STEPS, w.STEPS + w.MORE), world, None)
    assert_params(continued, w.params(ref_model), **TIGHT)


def test_state_dict_only_where_and_when_consolidated(group):
    world, results = group
    per_rank = check(results, "train")
    for r, res in enumerate(per_rank):
        if r != world - 1:
            elsewhere = res["elsewhere"]
            assert elsewhere.startswith("RuntimeError") and f"consolidated on rank {world - 1}" in elsewhere
    stale = per_rank[world - 1]["stale"]
    assert stale.startswith("RuntimeError") and "before the last 3 step(s)" in stale


def test_loads_a_torch_adagrad_checkpoint(group):
    world, results = group
    model, opt = w.reference(world, range(w.STEPS + w.MORE))
    for res in check(results, "load"):
        assert_params(res["params"], w.params(model), **TIGHT)
        assert res["lr"] == [0.1, 0.05]


def test_bad_arguments_raise_before_anything_changes(group):
    world, results = group
    for res in check(results, "bad_arguments"):
        assert res["lr"] == "ValueError: Invalid learning rate: -1.0"
        assert res["eps"] == "ValueError: Invalid epsilon value: -1.0"
        assert res["timeout"].startswith("ValueError") and "timeout" in res["timeout"]
        assert res["timeout_text"].startswith("TypeError: ZeroAdagrad: expected timeout as seconds")
        assert res["timeout_inf"] == res["timeout_max"] == "no error"
        assert res["differentiable"].startswith("ValueError") and "differentiable" in res["differentiable"]
        assert res["to_range"].startswith("ValueError") and "to (a rank" in res["to_range"]
        assert f"got {world}" in res["to_range"] and "got True" in res["to_bool"]
        assert res["state_dict_first"].startswith("RuntimeError: ZeroAdagrad: the optimizer state has not")
        assert res["add_group"].startswith("RuntimeError") and "add_param_group" in res["add_group"]
        assert res["load_groups"] == (
            "ValueError: ZeroAdagrad.load_state_dict: expected 2 parameter groups, got 1"
        )
        assert res["load_shape"].startswith("ValueError") and "parameter 5 of shape (3,)" in res["load_shape"]
        assert (
            res["load_no_sum"].startswith("KeyError")
            and "'sum' in the state of parameter 2" in res["load_no_sum"]
        )
        assert res["sparse_grad"].startswith("RuntimeError") and "parameter 5" in res["sparse_grad"]
        ours, theirs = res["fused_differentiable"]
        assert ours == theirs == "RuntimeError: `fused` does not support `differentiable`"
        assert res["duplicate"].startswith("ValueError") and "parameter 1 " in res["duplicate"]
        assert res["grad_on_some_ranks"].startswith("ValueError: ZeroAdagrad: parameter 0 ")
        assert f"has a gradient on {world - 1} of {world} ranks" in res["grad_on_some_ranks"]
        assert res["unchanged"], "a refused load_state_dict or step changed parameters or state"


def test_a_groups_own_initial_accumulator_value_is_not_used_as_in_torch(group):
    world, results = group
    for res in check(results, "group_initial_value"):
        assert_params(res["tandem"], res["torch"], **TIGHT)


def test_state_dict_hooks_run_as_in_torch(group):
    world, results = group
    for rank, res in enumerate(check(results, "state_dict_hooks")):
        loading = [f"load pre {rank}", "load post"]  # each rank loads its torch optimizer's state dict
        assert res["logs"]["torch"] == ["save pre", "save post", *loading]
        # rank 0 alone holds the consolidated state and saves
        assert res["logs"]["tandem"] == (["save pre", "save post"] if rank == 0 else []) + loading
        assert res["notes"] == ({"torch": 0, "tandem": 0} if rank == 0 else {"torch": rank})
        assert res["lr"]["tandem"] == res["lr"]["torch"] == [0.05, 0.025]


def test_mixed_dtypes(group):
    world, results = group
    m = w.Mixed()
    w.train(m, torch.optim.Adagrad(m.parameters(), lr=0.1, **w.HYPER), range(w.STEPS), world, None)
    per_rank = check(results, "mixed_dtypes")
    for res in per_rank:
        assert_params(res["params"], w.params(m), rtol=1e-5, atol=1e-6)  # float32 for the second layer
    for dtype, total in (("torch.float64", 35), ("torch.float32", 18)):
        sizes = [res["shards"][dtype] for res in per_rank]
        assert sum(sizes) == total and max(sizes) - min(sizes) <= 1


def test_half_types_with_weight_decay_equal_torchs_bit_for_bit(group):
    """Every rank's bfloat16 and float16 parameters after three steps with weight decay: torch's default
    Adagrad's, bit for bit, whatever the world size (they differed in a few elements at 2 and 3 ranks)."""
    _, results = group
    ps = w.half_params()
    opt = torch.optim.Adagrad(ps, lr=0.1, weight_decay=0.01)
    for step in range(3):
        w.half_grads(step, ps)
        opt.step()
    for res in check(results, "half_weight_decay"):
        for i, (got, want) in enumerate(zip(res["params"], ps)):
            # (float16 sums of squares underflow to 0 for the smallest gradients: NaN there, in both)
            torch.testing.assert_close(
                got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m, i=i: f"{i}: {m}"
            )


def test_different_parameters_raise_on_every_rank(group):
    world, results = group
    for res in check(results, "mismatch"):
        assert res["error"].startswith("ValueError: ZeroAdagrad: the optimizer's parameters"), res["error"]


def test_arguments_refused_on_one_rank_raise_on_every_rank_at_once(group):
    world, results = group
    per_rank = check(results, "one_rank_refuses")
    assert per_rank[-1]["error"] == "ValueError: Invalid learning rate: -1.0"  # torch's words
    for res in per_rank[:-1]:
        assert res["error"].startswith("ValueError: ZeroAdagrad: the optimizer's parameters"), res["error"]
        assert "Invalid learning rate: -1.0" in res["error"]
    assert all(res["seconds"] < 20 for res in per_rank), per_rank  # (the timeout is 60 s)


@pytest.mark.parametrize("when", ["after", "before"])
def test_a_model_made_channels_last_trains_as_torchs(group, when):
    """Converted after the optimizer was made (one rank never moved the weight; two raised after each had
    updated its own shards) or before (the constructor refused it): torch.optim.Adagrad's parameters."""
    world, results = group
    m = w.conv()
    opt = torch.optim.Adagrad(m.parameters(), lr=0.1, **w.HYPER)
    m.to(memory_format=torch.channels_last)
    w.train_channels_last(m, opt, range(w.STEPS))
    per_rank = [res[when] for res in check(results, "channels_last")]
    for res in per_rank:
        assert_params(res["params"], w.params(m), **TIGHT)
        assert res["channels_last"]  # stepped in a copy, written back into the parameter's own layout
    for res in per_rank[1:]:
        assert_params(res["params"], per_rank[0]["params"], rtol=0, atol=0)


def test_load_replaces_the_whole_state_and_copies_the_groups_as_torch(group):
    world, results = group
    # torch.optim.Adagrad trained too before the load: parameter 3, with no state in the checkpoint,
    # starts afresh at its next step
    m, opt = w.reference(world, range(w.STEPS))
    sd = w.checkpoint_without_state(world)
    opt.load_state_dict(sd)
    if "len(state) == 0" not in inspect.getsource(torch.optim.Adagrad._init_group):
        # torch 2.11's Adagrad makes every state at construction only: it raises KeyError at the step
        # where 2.13's (the reference, and ZeroAdagrad under either) starts parameter 3's state afresh
        for p in m.parameters():
            if not opt.state[p]:
                init = opt.defaults["initial_accumulator_value"]
                opt.state[p] = {"step": torch.tensor(0.0), "sum": torch.full_like(p, init)}
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(w.STEPS, w.STEPS + w.MORE):
        w.train(m, opt, range(step, step + 1), world, None)
        sched.step()
    for res in check(results, "load_replaces_state"):
        assert_params(res["params"], w.params(m), **TIGHT)
        # the scheduler's in-place change of the tensor lr left the loaded dict alone, as in torch
        assert res["checkpoint_lr"] == float(sd["param_groups"][0]["lr"]) == 0.1


def test_refusals_raise_on_every_rank_before_anything_moves(group):
    """(_check_refusals) Each refusal raises on every rank and moves no parameter, sum or step anywhere;
    the rank that refused says why, the others that it did. A frozen parameter keeps its version."""
    world, results = group
    for r, res in enumerate(check(results, "refusals")):
        for case, reason in [
            (
                "converted",
                "RuntimeError: ZeroAdagrad: parameter 0 is now [7, 6], torch.float32 on cpu; it was",
            ),
            ("grown", "RuntimeError: ZeroAdagrad: parameter 5 is now [5], torch.float64 on cpu; it was [3]"),
            ("lr_of_two_elements", "TypeError: Adagrad: expected lr as a number or a 1-element tensor"),
            (
                "bad_step_loaded",
                "ValueError: ZeroAdagrad.load_state_dict: expected state['step'] of parameter 1",
            ),
        ]:
            assert res[case]["error"].startswith(reason), (r, case, res[case]["error"])
            assert not res[case]["moved"], (r, case)
        refused = res["one_rank_refuses"]
        if r == world - 1:
            assert refused["error"].startswith(
                "RuntimeError: ZeroAdagrad: parameter 0 has a torch.sparse_coo gradient"
            )
        else:
            assert refused["error"].startswith(
                f"RuntimeError: ZeroAdagrad: 1 other rank(s) of {world} refused"
            )
        assert not refused["moved"]
        assert res["bad_step_loaded"]["lr"] == 0.1
        assert res["frozen"] == {"version_kept": True, "backward": "no error"}
        assert res["frozen_channels_last"] == {"version_kept": True, "backward": "no error"}


# ----------------------------------------------------------------------------------------------
# one rank, in this process

# (the fixture one_rank: conftest.py)


def test_one_rank_a_model_made_channels_last_after_the_optimizer_trains_as_torchs(one_rank):
    ours, theirs = w.conv(), w.conv()
    for m, opt in (
        (ours, ZeroAdagrad(ours.parameters(), lr=0.1, **w.HYPER)),
        (theirs, torch.optim.Adagrad(theirs.parameters(), lr=0.1, **w.HYPER)),
    ):
        m.to(memory_format=torch.channels_last)
        w.train_channels_last(m, opt, range(w.STEPS))
    assert ours.weight.is_contiguous(memory_format=torch.channels_last)
    assert_params(w.params(ours), w.params(theirs), **TIGHT)


def test_one_rank_maximize_steps_as_torchs(one_rank):
    """maximize=True, in one group of two: the update goes up the gradient, as torch's (every other test
    steps with False, so an update that ignored it passed them)."""
    trained = []
    for cls in (ZeroAdagrad, torch.optim.Adagrad):
        m = w.model()
        first, second = w.groups(m)
        second["maximize"] = True
        w.train(m, cls([first, second], **w.HYPER), range(w.STEPS), 1, None)
        trained.append(w.params(m))
    assert_params(trained[0], trained[1], **TIGHT)


def test_state_dict_has_the_groups_as_they_are_now_as_torchs(one_rank):
    saved = []
    for cls in (ZeroAdagrad, torch.optim.Adagrad):
        m = w.model()
        opt = cls(w.groups(m), **w.HYPER)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        w.train(m, opt, range(2), 1, None)
        if cls is ZeroAdagrad:
            opt.consolidate_state_dict(to=0)
        sched.step()  # after the state was gathered, no step in between
        opt.param_groups[1]["eps"] = 1e-3  # an edit by hand
        saved.append(opt.state_dict())
    ours, theirs = saved
    assert ours["param_groups"] == theirs["param_groups"]
    assert [g["lr"] for g in ours["param_groups"]] == [0.05, 0.025]


def test_load_state_dict_replaces_the_groups_as_torchs(one_rank):
    """torch's load_state_dict replaces each group by the saved one (its keys only, then Adagrad's
    defaults for those an old checkpoint lacks); ZeroAdagrad merged them, keeping the current group's
    maximize=True (and a user's key) where the saved dict had none, and stepped the other way."""
    sd = torch.optim.Adagrad([torch.zeros(2, requires_grad=True)], lr=0.1).state_dict()
    del sd["param_groups"][0]["maximize"]  # an older checkpoint's groups
    results = []
    for cls in (ZeroAdagrad, torch.optim.Adagrad):
        p = torch.zeros(2, requires_grad=True)
        opt = cls([{"params": [p], "tag": "mine"}], lr=0.1, maximize=True)
        opt.load_state_dict(copy.deepcopy(sd))
        p.grad = torch.ones(2)
        opt.step()
        results.append(({k: v for k, v in opt.param_groups[0].items() if k != "params"}, p.detach().clone()))
    (ours, p_ours), (theirs, p_theirs) = results
    assert ours == theirs and "tag" not in ours and ours["maximize"] is False
    assert torch.equal(p_ours, p_theirs)


# ----------------------------------------------------------------------------------------------
# in process: the layout


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_layout_covers_every_element_once(world):
    ps = [
        torch.zeros(5),
        torch.zeros(0),
        torch.zeros(2, 3),
        torch.zeros(1, dtype=torch.float64),
        torch.zeros(7),
    ]
    pieces, bounds = shard_layout(ps, world)
    for i, p in enumerate(ps):
        ranges = sorted((pc.start, pc.stop) for pc in pieces if pc.index == i)
        ends = [0] + [b for _, b in ranges]
        assert [a for a, _ in ranges] == ends[:-1] and ends[-1] == p.numel()  # back to back, all of it
    for key, cut in bounds.items():
        sizes = [cut[r + 1] - cut[r] for r in range(world)]
        assert max(sizes) - min(sizes) <= 1
        for r in range(world):
            owned = sum(pc.numel for pc in pieces if pc.owner == r and ps[pc.index].dtype == key[1])
            assert owned == sizes[r]


@pytest.mark.parametrize("world", [2, 3, 5])
def test_half_type_cuts_fall_at_multiples_of_64_from_a_parameter_start(world):
    ps = [torch.zeros(n, dtype=torch.bfloat16) for n in (1000, 130, 4099)] + [torch.zeros(1000)]
    pieces, bounds = shard_layout(ps, world)
    starts = {0, 1000, 1130}
    for cut in bounds[(torch.device("cpu"), torch.bfloat16)]:
        start = max(s for s in starts if s <= cut)
        assert (cut - start) % 64 == 0 or cut == 5229, cut
    # float32 goes to torch's fused kernel, whose results do not depend on the cut: equal shards
    cut = bounds[(torch.device("cpu"), torch.float32)]
    assert cut == [1000 * r // world for r in range(world + 1)]
