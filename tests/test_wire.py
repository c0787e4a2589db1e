"""Wire conversions: round trips, and malformed messages refused with the field named."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from presto_pb.v1 import common_pb2 as pb
from presto_sd.engine.messages import FeatureDelta, InvalidArgumentError
from presto_sd.method.acceptance import SamplingParams
from presto_sd.method.builders import RoundContext, TreeParams
from presto_sd.method.tree import TokenTree
from presto_sd.rpc import wire


@pytest.mark.parametrize("dtype", list(wire.DTYPES.values()))
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 5), (2, 0, 3)])
def test_tensor_round_trip(dtype, shape):
    t = (torch.randn(shape) * 50).to(dtype)
    back = wire.tensor_from_pb(pb.Tensor.FromString(wire.tensor_to_pb(t).SerializeToString()), "x")
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


@pytest.mark.parametrize("msg,needle", [
    (pb.Tensor(dtype="float8", shape=[1], data=b"\0"), "x.dtype = 'float8'"),
    (pb.Tensor(dtype="float32", shape=[2, 3], data=b"\0" * 20), "x.data: 20 bytes, expected 24"),
    (pb.Tensor(dtype="float32", shape=[-1], data=b""), "x.shape"),
    (pb.Tensor(dtype="int64", shape=[1], data=b"\0" * 8), "floating-point"),
    (pb.Tensor(dtype="float32", shape=[1] * 9, data=b"\0" * 4), "x.shape"),
])
def test_bad_tensors_name_the_field(msg, needle):
    with pytest.raises(InvalidArgumentError) as e:
        wire.tensor_from_pb(msg, "x", floating=True)
    assert needle in str(e.value)


def test_tree_round_trip_and_derived_depths():
    tree = TokenTree.from_lists([5, 1, 2, 3, 4], [-1, 0, 0, 1, 3])
    assert wire.tree_from_pb(wire.tree_to_pb(tree)) == tree
    assert wire.tree_from_pb(pb.TokenTree(tokens=tree.tokens, parents=tree.parents)) == tree


@pytest.mark.parametrize("msg,needle", [
    (pb.TokenTree(), "tree.tokens: empty"),
    (pb.TokenTree(tokens=[1], parents=[-1, 0, 1]), "lengths differ"),
    (pb.TokenTree(tokens=[1, 2], parents=[-1, 0], depths=[0]), "lengths differ"),
])
def test_bad_trees_name_the_field(msg, needle):
    with pytest.raises(InvalidArgumentError) as e:
        wire.tree_from_pb(msg)
    assert needle in str(e.value)


def test_params_round_trip_and_defaults():
    s = SamplingParams(0.7, 0.9, 5, seed=3)
    assert wire.sampling_from_pb(wire.sampling_to_pb(s)) == s
    assert wire.sampling_from_pb(pb.SamplingParams()) == SamplingParams()
    p = TreeParams(7, 4, branching=2, beam=3, lambdas=(0.5, 1.0), rho="constant", top_k=4)
    assert wire.tree_params_from_pb(wire.tree_params_to_pb(p)) == p
    assert wire.tree_params_from_pb(pb.TreeParams()) == TreeParams()


@pytest.mark.parametrize("msg,needle", [
    (pb.SamplingParams(top_p=0.0), "sampling.top_p"),
    (pb.SamplingParams(temperature=float("nan")), "sampling.temperature"),
    (pb.SamplingParams(top_k=-1), "sampling.top_k"),
])
def test_bad_sampling_names_the_field(msg, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        wire.sampling_from_pb(msg)


@pytest.mark.parametrize("msg,needle", [
    (pb.TreeParams(budget=0), "tree.budget"),
    (pb.TreeParams(lambdas=[float("inf")]), "tree.lambdas"),
    (pb.TreeParams(beam=0), "tree.beam = 0"),
    (pb.TreeParams(top_k=65), r"tree.top_k = 65: must be in \[1, 64\]"),
])
def test_bad_tree_params_name_the_field(msg, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        wire.tree_params_from_pb(msg)


def test_delta_round_trip_and_checks():
    d = FeatureDelta(3, (1, 2), torch.randn(2, 8))
    back = wire.delta_from_pb(wire.delta_to_pb(d))
    assert back.start == 3 and back.tokens == (1, 2) and torch.equal(back.features, d.features)
    with pytest.raises(InvalidArgumentError, match="delta.features: missing"):
        wire.delta_from_pb(pb.FeatureDelta(start=0, tokens=[1]))
    feats = wire.tensor_to_pb(torch.zeros(3, 2))
    with pytest.raises(InvalidArgumentError, match="delta.start"):
        wire.delta_from_pb(pb.FeatureDelta(start=-2, tokens=[1, 2, 3], features=feats))
    with pytest.raises(InvalidArgumentError, match="does not match 2 tokens"):
        wire.delta_from_pb(pb.FeatureDelta(start=0, tokens=[1, 2], features=feats))
    with pytest.raises(InvalidArgumentError, match="session.session_id"):
        wire.session_ref_from_pb(pb.SessionRef(session_id="", base=0))


def test_cost_model_round_trips_in_tree_params_and_verifier_info():
    from presto_sd.engine.verifier import VerifierInfo, VerifierLimits
    from presto_sd.method.acceptance_calibration import AcceptanceCalibration
    from presto_sd.method.cost_model import CostFit
    from presto_sd.method.tree import TreeLimits
    from verifier_service import wire as vwire

    fit = CostFit(0.03, 0.0015, 2e-5, 0.002, tree_s=0.017, n_obs=48)
    p = TreeParams(budget=64, node_penalty_s=0.001, depth_penalty=0.5)
    measured = RoundContext(cost=fit, draft_s=0.004, shared_tokens=3.0, round_trip_s=0.002,
                            calibration=AcceptanceCalibration(-0.4, 1.3, -0.2))
    msg = wire.tree_params_to_pb(p, measured)
    assert wire.tree_params_from_pb(msg) == p and wire.round_context_from_pb(msg) == measured
    assert wire.round_context_from_pb(wire.tree_params_to_pb(p)) == RoundContext()  # a request's tree: none
    unset = wire.round_context_from_pb(pb.TreeParams(method="taps"))
    assert unset.cost is None and unset.calibration.is_identity
    limits = VerifierLimits(tree=TreeLimits(vocab_size=10))
    info = VerifierInfo("m", "float32", "cpu", 10, (2,), (0, 1), limits)
    assert vwire.info_from_pb(vwire.info_to_pb(info)) == info  # uncalibrated: unset, None
    with_cost = replace(info, cost=fit, row_invariant=True, self_draft_block=3, decoder="owned",
                        weights="gguf-int4", attention_kernel="sdpa", prefill_chunk=256)
    assert vwire.info_from_pb(vwire.info_to_pb(with_cost)) == with_cost


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.1])
def test_bad_cost_coefficients_name_the_field(bad):
    msg = pb.TreeParams(method="taps", cost=pb.CostFit(intercept_s=0.01, per_node_s=bad))
    with pytest.raises(InvalidArgumentError, match="tree.cost"):
        wire.round_context_from_pb(msg)
    with pytest.raises(InvalidArgumentError, match="tree.draft_s"):
        wire.round_context_from_pb(pb.TreeParams(method="taps", draft_s=bad if bad < 0 else float("nan")))
    with pytest.raises(InvalidArgumentError, match="tree.calibration"):
        wire.round_context_from_pb(pb.TreeParams(
            method="taps", calibration=pb.AcceptanceCalibration(alpha=0.0, beta=bad, per_depth=0.0)))


def test_a_taps_draft_carries_its_raw_acceptance_over_the_wire():
    from drafter_service import wire as dwire
    from presto_sd.engine.drafter import DraftResult
    from presto_sd.method.scores import DraftMarginals

    tree = TokenTree.from_lists([5, 6, 7], [-1, 0, 0])
    marginals = DraftMarginals(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2), torch.zeros(1))
    r = DraftResult(tree, marginals, (0.0, -0.2, -0.9), 0.004, 0.001, (0.0, -0.1, -0.7))
    back = dwire.draft_result_from_pb(dwire.draft_result_to_pb(r, want_marginals=False))
    assert back.node_log_acceptance == r.node_log_acceptance and back.path_scores == r.path_scores
    old = dwire.draft_result_to_pb(replace(r, node_log_acceptance=()), want_marginals=False)
    assert dwire.draft_result_from_pb(old).node_log_acceptance == ()  # other methods, older drafters


def test_a_requests_tree_sets_configuration_not_a_rounds_measurements():
    """The fuzz found it: a GenerateRequest whose tree sets ``draft_s`` (a round's field on
    the shared wire message) crashed the job's conversion; it is not the request's to set."""
    from orchestrator import service
    from presto_pb.v1 import orchestrator_pb2
    from presto_sd.loop.generate import GenerationParams

    defaults = service.ServiceDefaults(GenerationParams(method="marginal", tree=TreeParams()), "m")
    tree = pb.TreeParams(budget=9, draft_s=0.5, cost=pb.CostFit(intercept_s=0.01))
    msg = orchestrator_pb2.GenerateRequest(token_ids=orchestrator_pb2.TokenIds(ids=[1, 2]), tree=tree)
    job = service.job_from_pb(msg, defaults, None)
    assert job.params.tree.budget == 9 and job.params.method == "marginal"


def test_one_method_per_request_and_per_draft_call():
    """A request names its method once (``method``); the tree message's method field is a
    draft call's: on a request it may only repeat the request's method. A draft call's
    method travels in it, and an unset one is the default method."""
    from drafter_service import wire as dwire
    from orchestrator import service
    from presto_pb.v1 import drafter_pb2, orchestrator_pb2
    from presto_sd.engine.drafter import DraftCall
    from presto_sd.loop.generate import GenerationParams
    from presto_sd.method.methods import DEFAULT_METHOD

    defaults = service.ServiceDefaults(GenerationParams(method="marginal", tree=TreeParams()), "m")
    ids = orchestrator_pb2.TokenIds(ids=[1, 2])
    same = orchestrator_pb2.GenerateRequest(token_ids=ids, method="taps", tree=pb.TreeParams(method="taps"))
    assert service.job_from_pb(same, defaults, None).params.method == "taps"
    for method, tree_method in ((None, "taps"), ("linear", "taps")):
        msg = orchestrator_pb2.GenerateRequest(token_ids=ids, method=method,
                                               tree=pb.TreeParams(method=tree_method))
        with pytest.raises(InvalidArgumentError, match="tree.method = 'taps'"):
            service.job_from_pb(msg, defaults, None)

    call = DraftCall("s", 7, 4, "presto-beam", TreeParams(budget=9), context=RoundContext(draft_s=0.01))
    assert dwire.draft_call_from_pb(dwire.draft_request_to_pb(call, want_marginals=False)) == call
    bare = drafter_pb2.DraftRequest(session=pb.SessionRef(session_id="s", base=4), anchor=7,
                                    params=pb.TreeParams(budget=9))
    assert dwire.draft_call_from_pb(bare).method == DEFAULT_METHOD
