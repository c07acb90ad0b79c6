"""Calibration of the drafter's confidence head by Sequential Temperature Scaling (DESIGN §6).

ECE uses equal-width bins on [0, 1]. For j = 1..γ in order, with T_1..T_{j-1} fixed, T_j is the
grid temperature minimising the ECE of the prefix survival a_j = Π_{i≤j} σ(z_i / T_i) against
1[k ≥ j] over the rounds that verified draft j (ℓ ≥ j). One temperature keeps each position's own
ranking, but a product of differently scaled factors can reorder slightly, which is why AUC is
reported before and after.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_jax.errors import DSparkError

FORMAT = "dspark-sts"
VERSION = 1


class CalibrationError(DSparkError):
    """A calibration file, record or temperature grid is missing, malformed or does not fit."""


# ---------------------------------------------------------------------------------------------
# Metrics


def _bin_index(scores: np.ndarray, bins: int) -> np.ndarray:
    """Equal-width bin of each score in [0, 1]; a score of exactly 1.0 joins the last bin."""
    return np.clip(np.floor(scores * bins).astype(np.int64), 0, bins - 1)


def _ece_rows(scores: np.ndarray, outcomes: np.ndarray, bins: int) -> np.ndarray:
    """ECE of each row of scores [G, n] against outcomes [n] -> [G]."""
    G, n = scores.shape
    flat = (_bin_index(scores, bins) + bins * np.arange(G)[:, None]).ravel()
    # Σ_b (n_b/n)|mean_s - mean_o| = Σ_b |Σ_{i∈b} (s_i - o_i)| / n: one weighted count per bin.
    gap = np.bincount(flat, weights=(scores - outcomes).ravel(), minlength=G * bins)
    return np.abs(gap.reshape(G, bins)).sum(axis=1) / n


def _as_pair(scores, outcomes) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, np.float64).ravel()
    o = np.asarray(outcomes, np.float64).ravel()
    if s.shape != o.shape:
        raise ValueError(f"{s.size} scores but {o.size} outcomes")
    if s.size == 0:
        raise ValueError("no scores: calibration metrics need at least one observation")
    return s, o


def ece(scores, outcomes, bins: int = 10) -> float:
    """Expected calibration error of scores [n] in [0, 1] against outcomes [n] in {0, 1}."""
    s, o = _as_pair(scores, outcomes)
    return float(_ece_rows(s[None], o, bins)[0])


def auc(scores, outcomes) -> float:
    """ROC AUC with ties counted half (Mann-Whitney U / (n_pos n_neg)); nan if a class is absent."""
    s, o = _as_pair(scores, outcomes)
    pos = o > 0.5
    n_pos = int(pos.sum())
    n_neg = s.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    end = np.cumsum(counts)  # 1-based rank of each tie group's last member
    ranks = (end - (counts - 1) / 2.0)[inverse.ravel()]  # average rank within a tie group
    u = ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def brier(scores, outcomes) -> float:
    """Mean squared error of scores [n] against outcomes [n]."""
    s, o = _as_pair(scores, outcomes)
    return float(np.mean((s - o) ** 2))


# ---------------------------------------------------------------------------------------------
# Survival and observations


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


def survival(z, temperatures) -> np.ndarray:
    """Raw confidence logits z [N, γ] and temperatures [γ] -> prefix survival a [N, γ] float64."""
    z = np.asarray(z, np.float64)
    t = np.asarray(temperatures, np.float64)
    # Summing log σ keeps deep prefixes of small factors from underflowing term by term.
    return np.exp(np.cumsum(_log_sigmoid(z / t), axis=-1))


def observations(verified, accepted, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """ℓ [N] and k [N] -> (observed [N, γ] bool: draft j+1 was verified,
    outcome [N, γ] bool: drafts 1..j+1 were all accepted)."""
    j = np.arange(gamma)
    ell = np.asarray(verified).reshape(-1, 1)
    k = np.asarray(accepted).reshape(-1, 1)
    return j < ell, j < k


def _check_record(z, verified, accepted) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validates one calibration record: z [N, γ], ℓ [N] in 0..γ, k [N] in 0..ℓ."""
    z = np.asarray(z, np.float64)
    ell = np.asarray(verified)
    k = np.asarray(accepted)
    if z.ndim != 2 or z.shape[1] == 0:
        raise CalibrationError(f"confidence logits must be [rounds, γ] with γ >= 1; "
                               f"got shape {z.shape}")
    n, gamma = z.shape
    if ell.shape != (n,) or k.shape != (n,):
        raise CalibrationError(f"{n} rounds of logits but verified has shape {ell.shape} and "
                               f"accepted has shape {k.shape}; expected ({n},) each")
    if not np.all(np.isfinite(z)):
        row = int(np.argwhere(~np.isfinite(z))[0, 0])
        raise CalibrationError(f"round {row}: confidence logits are not finite: {z[row].tolist()}")
    bad = (ell < 0) | (ell > gamma) | (k < 0) | (k > ell)
    if np.any(bad):
        row = int(np.argmax(bad))
        raise CalibrationError(f"round {row}: verified ℓ={int(ell[row])}, accepted k={int(k[row])}; "
                               f"expected 0 <= k <= ℓ <= γ={gamma}")
    return z, ell.astype(np.int64), k.astype(np.int64)


def _check_scored(z, verified, accepted, temperatures):
    """`_check_record` plus temperatures [γ]; returns (z, observed, outcome, temperatures)."""
    z, ell, k = _check_record(z, verified, accepted)
    temperatures = np.asarray(temperatures, np.float64)
    if temperatures.shape != (z.shape[1],):
        raise CalibrationError(f"{temperatures.size} temperatures for logits of γ={z.shape[1]}")
    return (z, *observations(ell, k, z.shape[1]), temperatures)


def default_grid() -> np.ndarray:
    """400 log-spaced temperatures in [0.05, 20], plus exactly 1.0 (the identity)."""
    return np.unique(np.append(np.geomspace(0.05, 20.0, 400), 1.0))


# ---------------------------------------------------------------------------------------------
# Sequential Temperature Scaling


def fit_sts(z, verified, accepted, grid=None, bins: int = 10) -> np.ndarray:
    """Raw logits z [N, γ], verified ℓ [N], accepted k [N] -> temperatures [γ] float64.

    A position no round verified keeps T = 1. Ties in ECE go to the temperature closest to 1 in log
    space, so including 1.0 in the grid makes each T_j no worse than the identity given T_1..T_{j-1}.
    """
    z, ell, k = _check_record(z, verified, accepted)
    grid = default_grid() if grid is None else np.asarray(grid, np.float64).ravel()
    if grid.size == 0 or not np.all(np.isfinite(grid) & (grid > 0)):
        raise CalibrationError(f"temperature grid must be finite numbers > 0; got {grid.tolist()}")
    gamma = z.shape[1]
    observed, outcome = observations(ell, k, gamma)
    temperatures = np.ones(gamma)
    distance = np.abs(np.log(grid))
    # Bounds the [chunk, n] score matrix at ~32 MB however many rounds there are.
    chunk = max(1, 4_000_000 // max(1, z.shape[0]))
    for j in range(gamma):
        rows = observed[:, j]
        if not rows.any():
            continue
        log_prefix = _log_sigmoid(z[rows, :j] / temperatures[:j]).sum(axis=1)  # [n]
        target = outcome[rows, j].astype(np.float64)
        prefix, z_j = np.exp(log_prefix), z[rows, j]
        with np.errstate(over="ignore"):  # exp(-x) = inf for x << 0 gives σ = 0, as it should
            errors = np.concatenate([
                _ece_rows(prefix / (1.0 + np.exp(-z_j / g[:, None])), target, bins)
                for g in np.array_split(grid, math.ceil(grid.size / chunk))])
        # Summation order can leave float noise between equal ECEs; treat those as ties.
        tied = errors <= errors.min() + 1e-12
        temperatures[j] = grid[tied][np.argmin(distance[tied])]
    return temperatures


def position_report(z, verified, accepted, temperatures, bins: int = 10) -> dict:
    """Per-position metrics before (all T = 1) and after STS; lists of length γ.

    None marks a position no round verified, and an AUC where every outcome was the same.
    """
    z, observed, outcome, temperatures = _check_scored(z, verified, accepted, temperatures)
    gamma = z.shape[1]
    before, after = survival(z, np.ones(gamma)), survival(z, temperatures)
    keys = ("n", "ece_before", "ece_after", "auc_before", "auc", "brier_before", "brier",
            "accept_rate")
    report: dict = {key: [] for key in keys}

    def defined(x: float):
        return None if math.isnan(x) else x

    for j in range(gamma):
        rows = observed[:, j]
        n = int(rows.sum())
        report["n"].append(n)
        if n == 0:
            for key in keys[1:]:
                report[key].append(None)
            continue
        o, b, a = outcome[rows, j], before[rows, j], after[rows, j]
        report["ece_before"].append(ece(b, o, bins))
        report["ece_after"].append(ece(a, o, bins))
        report["auc_before"].append(defined(auc(b, o)))
        report["auc"].append(defined(auc(a, o)))
        report["brier_before"].append(brier(b, o))
        report["brier"].append(brier(a, o))
        report["accept_rate"].append(float(o.mean()))
    seen = [j for j in range(gamma) if report["n"][j]]
    for when in ("before", "after"):
        values = [report[f"ece_{when}"][j] for j in seen]
        report[f"mean_ece_{when}"] = float(np.mean(values)) if values else None
    return report


# ---------------------------------------------------------------------------------------------
# The calibration file


def _check_temperatures(where: str, temperatures) -> tuple[float, ...]:
    """One error for the first entry that is not a finite number > 0 (positions are 1-based)."""
    if not isinstance(temperatures, (list, tuple, np.ndarray)):
        raise CalibrationError(f"{where}: \"temperatures\" must be a list of numbers; "
                               f"found {type(temperatures).__name__}")
    out = []
    for j, t in enumerate(temperatures, start=1):
        # bool is an int subclass; true/false in the file is a mistake, not a temperature.
        if isinstance(t, bool) or not isinstance(t, (int, float, np.integer, np.floating)):
            raise CalibrationError(f"{where}: temperature {j} is {t!r}; expected a number")
        if not (math.isfinite(t) and t > 0):
            raise CalibrationError(f"{where}: temperature {j} is {t!r}; expected a finite number > 0")
        out.append(float(t))
    return tuple(out)


def save_sts(path, temperatures, **metadata) -> Path:
    """Writes temperatures [γ] as JSON {"format": "dspark-sts", "version": 1, "block_size": γ,
    "temperatures": [...], **metadata}."""
    path = Path(path)
    temps = _check_temperatures(str(path), temperatures)
    reserved = sorted(set(metadata) & {"format", "version", "block_size", "temperatures"})
    if reserved:
        raise CalibrationError(f"{path}: metadata may not set {reserved}; "
                               "those keys are written by save_sts")
    data = {"format": FORMAT, "version": VERSION, "block_size": len(temps), "temperatures": list(temps),
            **metadata}
    text = json.dumps(data, indent=2) + "\n"
    # Write then rename, so a reader never sees half a file next to a checkpoint.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def load_sts(path, block_size: int) -> tuple[float, ...]:
    """Reads and checks the calibration file of a drafter of this block size -> temperatures [γ]."""
    path = Path(path)
    if not path.is_file():
        raise CalibrationError(f"{path}: no such STS calibration file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise CalibrationError(f"{path}: not valid JSON (line {err.lineno}, column {err.colno}: "
                               f"{err.msg})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise CalibrationError(f"{path}: cannot read STS calibration file ({err})") from None
    if not isinstance(data, dict):
        raise CalibrationError(f"{path}: expected a JSON object, found {type(data).__name__}")
    if data.get("format") != FORMAT:
        found = "missing" if "format" not in data else repr(data["format"])
        raise CalibrationError(f"{path}: \"format\" is {found}; expected \"{FORMAT}\"")
    if data.get("version", VERSION) != VERSION:
        raise CalibrationError(f"{path}: version {data['version']!r}; "
                               f"this build reads version {VERSION}")
    if "temperatures" not in data:
        raise CalibrationError(f"{path}: \"temperatures\" is missing; expected a list of numbers")
    temps = _check_temperatures(str(path), data["temperatures"])
    if "block_size" in data and data["block_size"] != len(temps):
        raise CalibrationError(f"{path}: \"block_size\" is {data['block_size']!r} but \"temperatures\" "
                               f"has {len(temps)} entries")
    if len(temps) != block_size:
        raise CalibrationError(f"{path}: {len(temps)} temperatures for a drafter with block size "
                               f"{block_size}; was it fitted for another drafter?")
    return temps



# ---------------------------------------------------------------------------------------------
# Reliability diagram


def reliability_diagram(z, verified, accepted, temperatures, path, bins: int = 10,
                        title: str = "") -> Path:
    """Writes a PNG: per position, observed prefix acceptance against mean predicted survival per
    score bin, raw (T = 1) and after STS. Bins of under 10 rounds are not drawn; ECE counts them."""
    # The Figure API with an explicit Agg canvas leaves pyplot's global backend and state alone,
    # and keeps matplotlib out of the import path of the engine.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    z, observed, outcome, temperatures = _check_scored(z, verified, accepted, temperatures)
    gamma = z.shape[1]
    curves = {"raw": survival(z, np.ones(gamma)), "STS": survival(z, temperatures)}

    cols = min(4, gamma)
    rows = math.ceil(gamma / cols)
    fig = Figure(figsize=(3.0 * cols, 3.0 * rows + 0.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    for j, ax in enumerate(axes.ravel()):
        if j >= gamma:
            ax.set_visible(False)
            continue
        ax.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=1)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"position {j + 1}  (T={temperatures[j]:.3g})", fontsize=9)
        sel = observed[:, j]
        if not sel.any():
            ax.text(0.5, 0.5, "no observations", ha="center", va="center", fontsize=9)
            continue
        o = outcome[sel, j].astype(np.float64)
        note = [f"n={int(sel.sum())}"]
        for (label, a), style in zip(curves.items(), ("o-", "s-")):
            s = a[sel, j]
            idx = _bin_index(s, bins)
            count = np.bincount(idx, minlength=bins)
            full = count >= 10  # a bin of a few rounds is noise that hides the curve
            mean_s = np.bincount(idx, weights=s, minlength=bins)[full] / count[full]
            mean_o = np.bincount(idx, weights=o, minlength=bins)[full] / count[full]
            ax.plot(mean_s, mean_o, style, markersize=3, linewidth=1.2, label=label)
            note.append(f"ECE {label} {ece(s, o, bins):.3f}")
        ax.text(0.03, 0.97, "\n".join(note), transform=ax.transAxes, ha="left", va="top", fontsize=7)
    for c in range(cols):  # under the lowest visible panel of each column
        axes[(gamma - 1 - c) // cols, c].set_xlabel("predicted prefix survival", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("observed acceptance", fontsize=8)
    axes[0, 0].legend(loc="lower right", fontsize=7)
    if title:
        fig.suptitle(title)
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path


def stack_rounds(results) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(z [N, γ], ℓ [N], k [N]) over every round with a proposal of the engine's results (decoded
    with `keep_confidences`)."""
    z, ell, k = [], [], []
    for res in results:
        for logits, verified, accepted in zip(res.conf_logits, res.verified, res.drafts_accepted):
            if logits and verified:
                z.append(logits)
                ell.append(verified)
                k.append(accepted)
    return np.asarray(z, np.float64), np.asarray(ell, np.int64), np.asarray(k, np.int64)


@dataclass(frozen=True)
class Fitted:
    """STS fitted on some requests' rounds and measured on the others'."""

    temperatures: np.ndarray
    report: dict  # position_report on the held-out rounds
    held_out: tuple[np.ndarray, np.ndarray, np.ndarray]  # (z, ℓ, k) of the held-out rounds
    prompts_fit: int
    prompts_eval: int
    fit_rounds: int


def fit_on_results(results, *, eval_fraction: float = 0.3, seed: int = 0, bins: int = 10) -> Fitted:
    """Splits the results (one per prompt) at random (`seed`), fits STS on the rounds of
    1 - eval_fraction of them and reports on the rounds of the rest."""
    order = np.random.default_rng(seed).permutation(len(results))
    n_eval = max(1, int(round(eval_fraction * len(results))))
    held = [results[i] for i in order[:n_eval]]
    fit = [results[i] for i in order[n_eval:]]
    z_fit, ell_fit, k_fit = stack_rounds(fit)
    evaluated = stack_rounds(held)
    if not len(z_fit) or not len(evaluated[0]):
        raise DSparkError("no decoding rounds with drafts to fit or to measure on (prompts too "
                          "short, or too few new tokens)")
    temps = fit_sts(z_fit, ell_fit, k_fit, bins=bins)
    return Fitted(temps, position_report(*evaluated, temps, bins=bins), evaluated, len(fit),
                  len(held), len(z_fit))
