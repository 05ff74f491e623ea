"""The parity report: numbers against one process, and what the wiring actually applied."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from titanext._text import format_table

__all__ = ["ParityReport", "build_report", "update_error"]

TOP = 10


@dataclass
class ParityReport:
    """The outcome of one parity check; ``ok`` is True when every number is within ``tol`` and
    every parallelism the mesh names asked for really ran.

    - ``losses``: per step, (parallel, single process, relative error);
    - ``grad_errors`` / ``param_errors``: the worst relative errors (parameter, error), after
      step 1 (gradients) and after the last step (parameters, relative to the update);
    - ``placements``: DTensor parameters and their placement on each mesh dim;
    - ``converted``: float8 and deferred-weight-gradient modules;
    - ``comm``: what ran, summed over ranks (EP all-to-alls, CP ring sends and collectives,
      attention blocks, pipeline stage forwards);
    - ``problems``: one line per reason ``ok`` is False (a replicated parameter whose
      gradient differs over a mesh dim's ranks among them:
      :mod:`titanext.plugins.replicated_grads`, checked after every step's backward);
    - ``notes``: what the check changed on both sides (train-mode dropout switched off).
    """

    ok: bool
    tol: float
    world_size: int
    mesh: dict[str, int]
    losses: list[tuple[float | None, float, float]] = field(default_factory=list)
    grad_errors: list[tuple[str, float]] = field(default_factory=list)
    param_errors: list[tuple[str, float]] = field(default_factory=list)
    placements: dict[str, dict[str, str]] = field(default_factory=dict)
    converted: dict[str, list[str]] = field(default_factory=dict)
    comm: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    #: the traceback of the rank that failed first (``python -m titanext.parity --traceback``)
    traceback: str | None = None

    def __str__(self) -> str:
        mesh = " x ".join(f"{n}={s}" for n, s in self.mesh.items())
        out = [f"parity check: {self.world_size} processes, mesh {mesh}, tol {self.tol:g}"]
        if self.error:
            out.append(f"error: {self.error}")
        if self.losses:
            out += ["", format_table([{"step": i + 1, "parallel": _g(par), "one process": _g(ref),
                                       "rel error": _e(err)}
                                      for i, (par, ref, err) in enumerate(self.losses)])]
        for title, rows in (("gradients after step 1", self.grad_errors),
                            (f"parameters after step {len(self.losses)} (relative to the update)",
                             self.param_errors)):
            if rows:
                out += ["", f"worst {title}:",
                        format_table([{"parameter": n, "rel error": _e(e)} for n, e in rows])]
        out += ["", "applied:", format_table(self._applied_rows())]
        out += [f"note: {n}" for n in self.notes]
        out += ["", "OK: matches one process" if self.ok else "FAILED:"]
        out += [f"  - {p}" for p in self.problems]
        return "\n".join(out)

    def _applied_rows(self) -> list[dict]:
        groups: dict[str, list[str]] = {}
        for name, pl in self.placements.items():
            groups.setdefault(", ".join(f"{d}: {p}" for d, p in pl.items()), []).append(name)
        rows = [{"what": f"DTensor [{key}]", "count": len(names), "where": _few(names)}
                for key, names in groups.items()]
        if not groups:
            rows.append({"what": "DTensor parameters", "count": 0, "where": ""})
        rows += [{"what": f"{kind} modules", "count": len(names), "where": _few(names)}
                 for kind, names in self.converted.items()]
        labels = {"ep_all_to_alls": "EP all-to-alls", "cp_sends": "CP ring sends",
                  "cp_collectives": "CP collectives", "cp_blocks": "CP attention blocks",
                  "pipeline_stages": "pipeline stages", "stage_forwards": "stage forwards",
                  "replicated_checked": "replicated grads checked (param x dim, per step)"}
        rows += [{"what": label, "count": self.comm.get(key, 0), "where": "all ranks"}
                 for key, label in labels.items()]
        return rows


def _g(v: float | None) -> str:
    return "-" if v is None else f"{v:.6f}"


def _e(v: float) -> str:
    return f"{v:.1e}"


def _few(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")


def _rel(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    denom = scale.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else (0.0 if diff == 0 else float("inf"))


def update_error(got: torch.Tensor, ref: torch.Tensor, start: torch.Tensor) -> float:
    """``|got - ref| / |ref - start|``: a parameter after some steps against the reference's, as a
    fraction of the update the reference made (a tensor that did not move: of its own norm).

    >>> update_error(torch.tensor([1.1]), torch.tensor([1.0]), torch.tensor([0.0]))
    0.10000002384185791
    """
    update = ref - start
    return _rel(got, ref, update if update.norm() > 0 else ref)


def _worst(errors: dict[str, float]) -> list[tuple[str, float]]:
    return sorted(errors.items(), key=lambda kv: -kv[1])[:TOP]


#: mesh dim name -> what must have happened when it has more than one rank
EXPECTATIONS = {
    "tp": "a parameter sharded on it",
    "dp_shard": "a parameter sharded on it",
    "fsdp": "a parameter sharded on it",
    "ep": "expert all-to-alls",
    "cp": "ring attention traffic",
    "pp": "pipeline stage forwards",
    "float8": "modules converted to float8",
    "deferred": "modules converted to deferred weight gradients",
}


def covers(dim: str, name: str) -> bool:
    """Whether mesh dim ``dim`` runs ``name``'s parallelism: the dim itself, or a flattened one
    made of it (``parallelize`` shards over ``dp_shard_cp``, dp_shard and cp flattened)."""
    return dim == name or dim.startswith(f"{name}_") or dim.endswith(f"_{name}") or (
        f"_{name}_" in dim)


def expectation_problems(mesh: dict[str, int], expect, placements, comm,
                         converted: dict[str, list[str]] | None = None) -> list[str]:
    """One line per mesh dim of size > 1 (or named in ``expect``) whose parallelism did not
    run, and per converter named in ``expect`` (``float8``, ``deferred``) that converted
    nothing: a requested degree or converter that changed nothing."""
    names = [n for n, s in mesh.items() if s > 1 and n in EXPECTATIONS] if expect is None \
        else list(expect)
    problems = []
    for name in names:
        if name in ("tp", "dp_shard", "fsdp"):
            ran = any("Shard" in placement for pl in placements.values()
                      for dim, placement in pl.items() if covers(dim, name))
        elif name == "ep":
            ran = comm.get("ep_all_to_alls", 0) > 0
        elif name == "cp":
            ran = comm.get("cp_sends", 0) + comm.get("cp_collectives", 0) > 0
        elif name == "pp":
            ran = comm.get("stage_forwards", 0) > 0
        elif name in ("float8", "deferred"):
            if not (converted or {}).get(name):
                problems.append(f"expect = {name!r} asks for {EXPECTATIONS[name]}, but there were "
                                "none: the wiring converted no module (see the 'applied' table)")
            continue
        else:
            continue
        if not ran:
            problems.append(f"mesh dim {name!r} (size {mesh.get(name, '?')}) asks for "
                            f"{EXPECTATIONS[name]}, but there were none: the wiring applied no "
                            f"{name} parallelism (see the 'applied' table)")
    return problems


def build_report(ranks: list[dict], ref: dict, *, tol: float, mesh: dict[str, int],
                 expect=None) -> ParityReport:
    """Compare every rank's run with the reference; a rank's error makes the report fail."""
    report = ParityReport(ok=False, tol=tol, world_size=len(ranks), mesh=mesh)
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        report.error = errors[0]
        report.problems = [errors[0]]
        failed = [r for r in ranks if r.get("own")] or [r for r in ranks if "traceback" in r]
        if failed:
            rank = failed[0].get("rank")
            report.traceback = (f"rank {rank}:\n" if rank is not None else "") + failed[0][
                "traceback"]
        return report
    first = ranks[0]
    for par, ref_loss in zip(first["losses"], ref["losses"]):
        err = float("inf") if par is None else abs(par - ref_loss) / max(abs(ref_loss), 1e-12)
        report.losses.append((par, ref_loss, err))
    grad_err, param_err, seen, replicated = {}, {}, set(), []
    for r in ranks:
        replicated += [line for line in r.get("replicated", ()) if line not in replicated]
        if r.get("dropout") and not report.notes:  # the same model on every rank
            report.notes.append(f"dropout switched off on both sides (their random masks "
                                f"cannot agree): {len(r['dropout'])} in {_few(r['dropout'], 4)}")
        for name, g in r["grads"].items():
            e = _rel(g, ref["grads"].get(name, torch.zeros_like(g)), ref["grads"].get(name, g))
            grad_err[name] = max(grad_err.get(name, 0.0), e)
        for name in r["no_grad"]:
            if name in ref["grads"]:
                grad_err[name] = float("inf")
        for name, p in r["params"].items():
            param_err[name] = max(param_err.get(name, 0.0),
                                  update_error(p, ref["params"][name], ref["start"][name]))
            seen.add(name)
        report.placements.update(r["applied"]["placements"])
        for kind in ("float8", "deferred"):
            names = report.converted.setdefault(kind, [])
            names += [n for n in r["applied"][kind] if n not in names]
        for key, value in r["comm"].items():
            report.comm[key] = report.comm.get(key, 0) + value
    report.grad_errors, report.param_errors = _worst(grad_err), _worst(param_err)
    problems = report.problems
    bad_loss = [i + 1 for i, (_, _, e) in enumerate(report.losses) if not e <= tol]
    if bad_loss:
        problems.append(f"loss differs from one process at step(s) {bad_loss} (worst "
                        f"{max(report.losses[i - 1][2] for i in bad_loss):.1e} > {tol:g})")
    for what, rows in (("gradient", report.grad_errors), ("parameter", report.param_errors)):
        bad = [(n, e) for n, e in rows if not e <= tol]
        if bad:
            problems.append(f"{what}s differ from one process: {bad[0][0]} {bad[0][1]:.1e}"
                            f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''} (> {tol:g})")
    missing = sorted(set(ref["params"]) - seen)
    if missing:
        problems.append(f"{len(missing)} parameter(s) of the model are on no rank after wiring: "
                        f"{_few(missing)}")
    if replicated:
        problems.append(f"replicated gradients differ: {replicated[0]}"
                        f"{f' (and {len(replicated) - 1} more)' if len(replicated) > 1 else ''}")
    problems += expectation_problems(mesh, expect, report.placements, report.comm,
                                     report.converted)
    report.ok = not problems
    return report
