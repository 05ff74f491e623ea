"""The parity check: your model, your wiring, N local gloo processes against one process.

The package only re-exports: the settings and the runs are :mod:`~titanext.parity.checks`, a
rank's view and the default loss :mod:`~titanext.parity.context`, the report
:mod:`~titanext.parity.report`.

Before a long job, run a tiny configuration of your own model through your own parallel
wiring on CPU, and compare it with one plain process on the same global batch::

    from titanext.parity import check

    def build():                       # the model, the same on every rank (seeded for you)
        return MyLM(vocab=128, dim=64, layers=2)

    def wire(model, ctx):              # your parallelism; ctx.mesh is the DeviceMesh
        apply_tensor_parallel(model, ctx.mesh["tp"], plan=MY_PLAN)
        return model

    report = check(build, wire, world_size=2, mesh_names=("tp",))
    print(report)                      # tables: losses, worst errors, what was applied
    assert report.ok

or from the command line (exit 0 within tolerance, 1 beyond, 2 on bad arguments)::

    python -m titanext.parity --model mypkg.lm:build --wiring mypkg.lm:wire \\
        --world-size 2 --mesh-names tp

The report has the loss per step (parallel against one process), the ten worst gradient
relative errors after step 1 and parameter errors after the last step, and what the wiring
applied: DTensor parameters and their placements per mesh dim, float8 and deferred-dW
modules, and whether expert all-to-alls, ring attention or pipeline stages ran. A mesh dim of
size > 1 named tp, dp_shard / fsdp, ep, cp or pp that changed nothing fails the check (a
requested parallelism that silently did nothing), as does any number beyond ``tol``, a
converter named in ``expect`` (``float8``, ``deferred``) that converted nothing, and a
replicated parameter whose gradient differs between the ranks of a mesh dim
(:mod:`titanext.plugins.replicated_grads`, after every step). Parameters and gradients are read
through ``named_parameters()`` and ``full_tensor()``, never ``state_dict()`` (hooks may rename
entries there); train-mode dropout is switched off on both sides, and the report says so.

The contract, per rank: ``build()`` returns the model (fp32, on CPU); ``wiring(model, ctx)``
applies your parallelism and returns the module to train (or a pipeline object with
``.parts``); ``loss_fn(wired, inputs, labels, ctx)`` takes the *global* batch, feeds this
rank's share and returns the loss to backpropagate (None where a rank computes none; a loss
that needs no grad is taken as already backpropagated, e.g. by a pipeline schedule). The
default :func:`lm_loss` is a causal LM's mean cross entropy over the rank's tokens: rows split
over the data dims (dp, dp_shard, fsdp, ep, ...), the sequence over cp (zigzag, with
``position_ids=`` when the forward takes it). Gradients must come out as one process's
(FSDP's averaging does that; a hand-made all-reduce must divide by the ranks).

Runnable example: ``examples/parity_check.py`` (docs/own_model.md).
"""

from __future__ import annotations

from titanext.parity.checks import OPTIMIZERS as OPTIMIZERS
from titanext.parity.checks import ParityCheck, check, check_all, problems_of
from titanext.parity.context import DATA_DIMS, ParityContext, lm_loss, reference_lm_loss
from titanext.parity.report import ParityReport

__all__ = ["check", "check_all", "ParityCheck", "ParityContext", "ParityReport", "lm_loss",
           "reference_lm_loss", "problems_of", "DATA_DIMS"]
