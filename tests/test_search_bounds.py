"""The plan search leaves unlowered only what a bound shows cannot be the pick (xtrain.cost.sweep):
each bound is checked here against the same candidate lowered by a search that prunes nothing,
and the picks agree, also when the target's compiler rejects the fastest and the bounds must be
re-checked against a slower one."""
import dataclasses

import pytest

from test_cost import host_batch, wrapped_gpt
from xtrain.cost import hardware, search, sweep
from xtrain.lowering.pipeline import schedule
from xtrain.frontend.structure import describe

C = search.Candidate
# one family per bound: remat (act-offload dominated by it), optimizer offload (still short without
# its state), tensor parallel (its plain form's compute alone too slow), a pipeline (its data-parallel
# twin's compute over the schedule's busy share too slow, its variants with it), a pipeline whose twin
# is not listed (lowered; zero bubble bounded by its GPipe form without the bubble), context parallel
# (its data-parallel twin holds the same tokens per device without the sequence split's transfers)
LISTED = [C(data=8, zero=1), C(data=8, zero=1, remat=True), C(data=8, zero=1, offload="optimizer"),
          C(data=8, zero=1, offload="activations"),
          C(data=2, tensor=4, zero=1), C(data=2, tensor=4, zero=1, remat=True),
          C(data=2, tensor=4, zero=1, offload="optimizer"),
          C(data=4, pipe=2, microbatches=2), C(data=4, pipe=2, microbatches=2, remat=True),
          C(data=4, pipe=2, microbatches=2, schedule="1f1b"), C(data=4, pipe=2, microbatches=2, schedule="zbh1"),
          C(data=2, tensor=2, pipe=2, microbatches=2), C(data=2, tensor=2, pipe=2, microbatches=2, schedule="zbh1"),
          C(data=4, context=2, zero=1), C(data=4, context=2, ulysses=2, zero=1), C(data=4, context=2, zero=1, remat=True)]


@pytest.fixture(scope="module")
def setting():
    # big enough for compute to outweigh the links on an A100 profile (lowering cost does not grow)
    model, wrapped, tx = wrapped_gpt(d=512, layers=4, vocab=256, seq=1024)
    batch, profile = host_batch(batch=16, seq=1024), hardware.profile("p4d.24xlarge")
    kwargs = dict(structure=describe(model))
    need = search.search(wrapped, tx, batch, profile, 8, candidate_list=LISTED[:1], **kwargs).rows[0].prediction
    small = profile.with_memory(int(need.memory_bytes * 0.8))  # the plain dp8 does not fit; its remat does

    def run(**extra):
        result = search.search(wrapped, tx, batch, small, 8, candidate_list=LISTED, **kwargs, **extra)
        return result, {r.candidate.name: r for r in result.rows}

    return small, run


@pytest.mark.e2e
def test_every_bound_holds_and_the_pick_is_the_unpruned_searchs(setting):
    profile, run = setting
    (pruned, rows), (full, every) = run(), run(prune_remat=False)
    assert all(r.prediction is not None for r in full.rows)
    assert pruned.best.candidate == full.best.candidate == C(data=8, zero=1, remat=True)
    skipped = {name: r.reason for name, r in rows.items() if r.prediction is None}
    assert set(skipped) == {"dp8 zero1 offload", "dp8 zero1 act-offload", "dp2xtp4 zero1 remat",
                            "dp2xtp4 zero1 offload", "dp4xpp2 gpipe m2", "dp4xpp2 gpipe m2 remat", "dp4xpp2 1f1b m2",
                            "dp2xpp2xtp2 zbh1 m2", "dp4xcp2 zero1", "dp4xcp2 zero1 ulysses",
                            "dp4xcp2 zero1 remat"}, skipped
    # each bound against the candidate as lowered
    plain = rows["dp8 zero1"].cost.memory
    assert skipped["dp8 zero1 offload"].startswith("not lowered: its plain form less its whole optimizer state")
    assert plain.total - plain.optimizer > profile.hbm_bytes and not every["dp8 zero1 offload"].prediction.fits
    assert skipped["dp8 zero1 act-offload"] == sweep.ACT_OFFLOAD_DOMINATED
    assert every["dp8 zero1 act-offload"].prediction.step_s >= every["dp8 zero1 remat"].prediction.step_s
    for name, of in (("dp2xtp4 zero1 remat", "dp2xtp4 zero1"), ("dp2xtp4 zero1 offload", "dp2xtp4 zero1")):
        assert skipped[name].startswith("not lowered: its plain form's compute alone"), skipped[name]
        floor = rows[of].prediction.compute_s
        assert floor > pruned.best.prediction.step_s * (1 + search.TIE)
        assert every[name].prediction.step_s >= floor, name
    # a pipeline (and its variants): its data-parallel twin's compute over the schedule's busy share
    twin = rows["dp8 zero1"].prediction.compute_s
    floor = twin / (1 - schedule.build("gpipe", 2, 2).bubble())
    assert floor > pruned.best.prediction.step_s * (1 + search.TIE)
    for name in ("dp4xpp2 gpipe m2", "dp4xpp2 gpipe m2 remat", "dp4xpp2 1f1b m2"):
        assert skipped[name].startswith("not lowered: its data-parallel twin dp8 zero1 computes for"), skipped[name]
        assert every[name].prediction.compute_s >= floor, name
    # the same bound for zero bubble (its smaller bubble: within TIE of the fastest here, so lowered)
    assert every["dp4xpp2 zbh1 m2"].prediction.compute_s >= twin / (1 - schedule.build("zbh1", 2, 2).bubble())
    gpipe = rows["dp2xpp2xtp2 gpipe m2"]
    assert skipped["dp2xpp2xtp2 zbh1 m2"] == search.SKIPPED_ZERO_BUBBLE
    assert every["dp2xpp2xtp2 zbh1 m2"].prediction.step_s >= \
        gpipe.prediction.step_s * (1 - gpipe.cost.pipeline.bubble_fraction)
    # a sequence split where the batch divides over data x context: its data-parallel twin dominates it
    for name, twin in (("dp4xcp2 zero1", "dp8 zero1"), ("dp4xcp2 zero1 ulysses", "dp8 zero1"),
                       ("dp4xcp2 zero1 remat", "dp8 zero1 remat")):
        assert skipped[name] == sweep.CONTEXT_DOMINATED.format(twin=twin), skipped[name]
        assert every[name].prediction.step_s >= every[twin].prediction.step_s, name
        assert every[name].prediction.memory_bytes >= every[twin].prediction.memory_bytes, name
    text = pruned.listing()
    assert "(11 candidates not lowered" in text and "its plain form's compute alone" in pruned.listing(show_all=True)


@pytest.mark.e2e
def test_what_the_bounds_skipped_is_lowered_when_the_compiler_rejects_the_fastest(setting):
    _, run = setting
    calls = []

    def verify(row, plan):  # a compiler that finds every data-parallel plan too big for the device
        calls.append(row.candidate.name)
        fits = row.candidate.tensor > 1 or row.candidate.pipe > 1
        return search.Verified(fits=fits, memory_bytes=row.prediction.memory_bytes)

    (pruned, rows), (full, _) = run(verify=verify), run(verify=verify, prune_remat=False)
    assert pruned.best.candidate == full.best.candidate and pruned.best.verified.fits
    assert pruned.best.candidate.data < 8 and rows["dp8 zero1 remat"].verified.fits is False
    # the slower families' variants the first pass skipped against dp8's remat were lowered after all
    assert all(rows[n].prediction is not None for n in ("dp2xtp4 zero1 remat", "dp4xpp2 gpipe m2 remat"))
    assert dataclasses.replace(pruned.best.candidate, order=()) in LISTED
