"""Calibration of the drafter's confidence head by Sequential Temperature Scaling (DESIGN §6).

ECE uses equal-width bins on [0, 1]. For j = 1..γ in order, with T_1..T_{j-1} fixed, T_j is the
grid temperature minimising the ECE of the prefix survival a_j = Π_{i≤j} σ(z_i / T_i) against
1[k ≥ j] over the rounds that verified draft j (ℓ ≥ j). One temperature keeps each position's own
ranking, but a product of differently scaled factors can reorder slightly, which is why AUC is
reported before and after.

Three methods. `sts` is the paper's: temperatures only, on a wide grid. `sts-bias` (ours) fits a
temperature and a bias per position, a_j = Π_{i≤j} σ(z_i / T_i + b_i), by the same sequential grid
search on a narrower temperature grid. A temperature can only move confidences towards or away
from 1/2, so a head whose confidences are off by a constant (the tiny demo pair's, trained on one
corpus and served on another) keeps most of its ECE under `sts`; the bias removes it, and the
narrow grid keeps the product's ranking, hence AUC, close to the raw one (measured in the issue
notes). With all biases 0 the two are the same map.

`sts-rank` (ours, the default) keeps every position's ranking exactly: the temperature and bias
act on the log prefix survival itself, a_j = exp(log(Π_{i≤j} σ(z_i)) / T_j + b_j), a strictly
increasing map of the raw a_j, so the AUC at every position is the raw one to the last digit.
Among maps that scale each factor on its own, a_j = Π_{i≤j} f_i(σ(z_i)), only f_i(p) = k_i·p^α,
one α for all the factors, keeps a_j an increasing function of the raw product for every input:
`sts-rank` is that, with α = 1/T_j at position j. For the calibrated survival to stay a
probability that never rises along the block (what top-K's rank argument and Algorithm 1's sums
need) whatever the raw confidences, the fit keeps b_1 ≤ 0, b_j ≤ b_{j-1} and T_j ≤ T_{j-1}: then
a_j ≤ 1 and, with raw a_j ≤ raw a_{j-1} ≤ 1, a_j ≤ a_{j-1} in every round. So it lifts
confidences only through T_j > 1 (an underconfident head keeps more of its error than under
`sts-bias`; the bundled drafter's head is overconfident on new prompts). The price is
expressiveness: `sts-bias` may re-weight the factors and so re-rank rounds, which on held-out
rounds moves AUC up at some positions and down at others and gives a slightly lower Brier score
(BENCHMARKS.md, "Calibration on held-out benchmark prompts").
The engine reads the form from sts.json (`"form": "factor"` or `"survival"`).
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
VERSION = 3  # 2 added "biases", 3 "form"; versions 1 and 2 (factor form) still load
METHODS = ("sts-rank", "sts-bias", "sts")  # the default first
FORMS = ("factor", "survival")  # what T_j and b_j scale: each factor's logit, or log a_j


@dataclass(frozen=True)
class Sts:
    """A fitted calibration per draft position: form "factor", c_j = σ(z_j / temperatures[j] +
    biases[j]) and a_j = Π_{i≤j} c_i; form "survival", a_j = exp(log(Π_{i≤j} σ(z_i)) /
    temperatures[j] + biases[j]) and c_j = a_j / a_{j-1}."""

    temperatures: tuple[float, ...]
    biases: tuple[float, ...]
    form: str = "factor"

    @classmethod
    def of(cls, value) -> "Sts":
        """An Sts, or a sequence of temperatures (biases 0, factor form)."""
        if isinstance(value, Sts):
            return value
        temps = tuple(float(t) for t in value)
        return cls(temps, (0.0,) * len(temps))

    def __len__(self) -> int:
        return len(self.temperatures)


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


def ece_floor(scores, bins: int = 10, draws: int = 200, seed: int = 0) -> float:
    """The ECE a perfectly calibrated head would show on these rounds: the mean ECE of `scores`
    against outcomes drawn from them (round i survives with probability s_i), over `draws` draws.

    Each bin's observed rate is a sample of its few rounds, so the ECE measured on n rounds of even
    a perfect head is about sqrt(2 / pi) x the sampling spread of those rates (of the order of
    sqrt(bins / n) / 2 for scores near 1/2): an ECE close to this floor is as calibrated as n rounds
    can tell apart."""
    s = np.clip(np.asarray(scores, np.float64).ravel(), 0.0, 1.0)
    if s.size == 0:
        raise ValueError("no scores: calibration metrics need at least one observation")
    o = (np.random.default_rng(seed).random((draws, s.size)) < s).astype(np.float64)
    flat = (_bin_index(s, bins)[None] + bins * np.arange(draws)[:, None]).ravel()
    gap = np.bincount(flat, weights=(s[None] - o).ravel(), minlength=draws * bins)
    return float(np.abs(gap.reshape(draws, bins)).sum(axis=1).mean() / s.size)


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


def _unpack(temperatures, biases) -> tuple[np.ndarray, np.ndarray, str]:
    """(temperatures, biases, form) from an `Sts`, or from temperatures [γ] and biases [γ]
    (default 0) of the factor form."""
    if isinstance(temperatures, Sts):
        return (np.asarray(temperatures.temperatures, np.float64),
                np.asarray(temperatures.biases, np.float64), temperatures.form)
    t = np.asarray(temperatures, np.float64)
    return t, (np.zeros_like(t) if biases is None else np.asarray(biases, np.float64)), "factor"


def survival(z, temperatures, biases=None) -> np.ndarray:
    """Raw confidence logits z [N, γ] and a calibration (an `Sts`, or temperatures [γ] and biases
    [γ], default 0, of the factor form) -> prefix survival a [N, γ] float64."""
    z = np.asarray(z, np.float64)
    t, b, form = _unpack(temperatures, biases)
    # Summing log σ keeps deep prefixes of small factors from underflowing term by term.
    if form == "survival":
        return np.exp(np.minimum(np.cumsum(_log_sigmoid(z), axis=-1) / t + b, 0.0))
    return np.exp(np.cumsum(_log_sigmoid(z / t + b), axis=-1))


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


def _check_scored(z, verified, accepted, temperatures, biases=None):
    """`_check_record` plus a calibration (an `Sts`, or temperatures [γ] and biases [γ], default
    0); returns (z, observed, outcome, the calibration as an `Sts`)."""
    z, ell, k = _check_record(z, verified, accepted)
    temperatures, biases, form = _unpack(temperatures, biases)
    if temperatures.shape != (z.shape[1],):
        raise CalibrationError(f"{temperatures.size} temperatures for logits of γ={z.shape[1]}")
    if biases.shape != temperatures.shape:
        raise CalibrationError(f"{biases.size} biases for {temperatures.size} temperatures")
    return (z, *observations(ell, k, z.shape[1]),
            Sts(tuple(temperatures.tolist()), tuple(biases.tolist()), form))


def default_grid() -> np.ndarray:
    """400 log-spaced temperatures in [0.05, 20], plus exactly 1.0 (the identity)."""
    return np.unique(np.append(np.geomspace(0.05, 20.0, 400), 1.0))


def bias_grids() -> tuple[np.ndarray, np.ndarray]:
    """`sts-bias`'s grids: 41 log-spaced temperatures in [0.5, 2] plus 1.0, and 161 biases in
    [-4, 4] (steps of 0.05, 0 included)."""
    return (np.unique(np.append(np.geomspace(0.5, 2.0, 41), 1.0)),
            np.round(np.linspace(-4.0, 4.0, 161), 10))


# ---------------------------------------------------------------------------------------------
# Sequential Temperature Scaling


def fit_sts(z, verified, accepted, grid=None, bins: int = 10, bias_grid=None) -> np.ndarray | Sts:
    """Raw logits z [N, γ], verified ℓ [N], accepted k [N] -> temperatures [γ] float64 (`bias_grid`
    None: the paper's STS), or an `Sts` of temperatures and biases searched jointly on `grid` x
    `bias_grid`, position by position.

    A position no round verified keeps T = 1, b = 0. Ties in ECE go to the pair closest to the
    identity (|log T| first, then |b|), so a grid holding T = 1 and b = 0 makes each position no
    worse than the identity given the positions before it.
    """
    z, ell, k = _check_record(z, verified, accepted)
    grid = default_grid() if grid is None else np.asarray(grid, np.float64).ravel()
    if grid.size == 0 or not np.all(np.isfinite(grid) & (grid > 0)):
        raise CalibrationError(f"temperature grid must be finite numbers > 0; got {grid.tolist()}")
    biases_grid = np.zeros(1) if bias_grid is None else np.asarray(bias_grid, np.float64).ravel()
    if biases_grid.size == 0 or not np.all(np.isfinite(biases_grid)):
        raise CalibrationError(f"bias grid must be finite numbers; got {biases_grid.tolist()}")
    gamma = z.shape[1]
    observed, outcome = observations(ell, k, gamma)
    # Every (temperature, bias) pair as one candidate: inverse temperatures and biases [G].
    inv_t = np.repeat(1.0 / grid, biases_grid.size)
    bias = np.tile(biases_grid, grid.size)
    distance = np.stack([np.repeat(np.abs(np.log(grid)), biases_grid.size), np.abs(bias)])
    temperatures, biases = np.ones(gamma), np.zeros(gamma)
    # Bounds the [chunk, n] score matrix at ~32 MB however many rounds there are.
    chunk = max(1, 4_000_000 // max(1, z.shape[0]))
    for j in range(gamma):
        rows = observed[:, j]
        if not rows.any():
            continue
        log_prefix = _log_sigmoid(z[rows, :j] / temperatures[:j] + biases[:j]).sum(axis=1)  # [n]
        target = outcome[rows, j].astype(np.float64)
        prefix, z_j = np.exp(log_prefix), z[rows, j]
        with np.errstate(over="ignore"):  # exp(-x) = inf for x << 0 gives σ = 0, as it should
            errors = np.concatenate([
                _ece_rows(prefix / (1.0 + np.exp(-(z_j * a[:, None] + b[:, None]))), target, bins)
                for a, b in zip(np.array_split(inv_t, math.ceil(inv_t.size / chunk)),
                                np.array_split(bias, math.ceil(bias.size / chunk)))])
        # Summation order can leave float noise between equal ECEs; treat those as ties.
        tied = np.flatnonzero(errors <= errors.min() + 1e-12)
        best = tied[np.lexsort((distance[1, tied], distance[0, tied]))[0]]
        temperatures[j], biases[j] = 1.0 / inv_t[best], bias[best]
    if bias_grid is None:
        return temperatures
    return Sts(tuple(temperatures.tolist()), tuple(biases.tolist()))


def rank_grids() -> tuple[np.ndarray, np.ndarray]:
    """`sts-rank`'s grids: `sts-bias`'s 42 temperatures in [0.5, 2], and 81 biases in [-4, 0]
    (steps of 0.05; a positive one could lift a_j above 1)."""
    temps, biases = bias_grids()
    return temps, biases[biases <= 0.0]


def fit_sts_rank(z, verified, accepted, grid=None, bias_grid=None, bins: int = 10) -> Sts:
    """Raw logits z [N, γ], verified ℓ [N], accepted k [N] -> an `Sts` of the survival form:
    a_j = exp(log raw a_j / T_j + b_j), (T_j, b_j) on `grid` x `bias_grid` (default `rank_grids`)
    with T_j ≤ T_{j-1} and b_j ≤ b_{j-1} ≤ 0, which keep a_j ≤ 1 and never rising along j (module
    docstring). Position j's ECE depends on its own pair only, so the pairs minimising the sum of
    the positions' ECEs under those constraints are found exactly, by dynamic programming over
    the grid (a position-by-position search would let an early pair rule out every later one).

    A position no round verified keeps its predecessor's pair. Ties go to the pair closest to the
    identity (|log T| first, then |b|), from the last position back."""
    z, ell, k = _check_record(z, verified, accepted)
    default_t, default_b = rank_grids()
    grid = default_t if grid is None else np.asarray(grid, np.float64).ravel()
    if grid.size == 0 or not np.all(np.isfinite(grid) & (grid > 0)):
        raise CalibrationError(f"temperature grid must be finite numbers > 0; got {grid.tolist()}")
    biases_grid = default_b if bias_grid is None else np.asarray(bias_grid, np.float64).ravel()
    if biases_grid.size == 0 or not np.all(np.isfinite(biases_grid) & (biases_grid <= 0)):
        raise CalibrationError(f"sts-rank's bias grid must be finite numbers <= 0; "
                               f"got {biases_grid.tolist()}")
    gamma = z.shape[1]
    observed, outcome = observations(ell, k, gamma)
    log_raw = np.cumsum(_log_sigmoid(z), axis=1)  # [N, γ] log of the raw prefix survival
    grid, biases_grid = np.unique(grid), np.unique(biases_grid)  # ascending: the DP's order
    temps = np.repeat(grid, biases_grid.size)  # candidate (T, b) pairs, T-major
    bias = np.tile(biases_grid, grid.size)
    distance = np.stack([np.abs(np.log(temps)), np.abs(bias)])
    seen = [j for j in range(gamma) if observed[:, j].any()]  # a prefix of the positions
    chunk = max(1, 4_000_000 // max(1, z.shape[0]))
    shape = (grid.size, biases_grid.size)
    # value[j][T, b]: the least sum of ECEs over positions 0..j with position j at (T, b) and
    # every earlier one at a pair >= it in both coordinates (the constraints, read backwards).
    value = []
    for j in seen:
        rows = observed[:, j]
        x, target = log_raw[rows, j], outcome[rows, j].astype(np.float64)
        errors = np.concatenate([
            _ece_rows(np.exp(np.minimum(x / temps[c, None] + bias[c, None], 0.0)), target, bins)
            for c in np.array_split(np.arange(temps.size), math.ceil(temps.size / chunk))])
        if value:  # the best predecessor among the pairs with T' >= T and b' >= b
            best = np.minimum.accumulate(value[-1][::-1], axis=0)[::-1]
            errors = errors + np.minimum.accumulate(best[:, ::-1], axis=1)[:, ::-1].ravel()
        value.append(errors.reshape(shape))
    temperatures, biases = np.ones(gamma), np.zeros(gamma)
    floor_t, floor_b = -np.inf, -np.inf  # the pair chosen for the next position, walking back
    for j in reversed(seen):
        v = value[j].ravel()
        ok = np.flatnonzero((temps >= floor_t) & (bias >= floor_b))
        tied = ok[np.flatnonzero(v[ok] <= v[ok].min() + 1e-12)]
        pick = tied[np.lexsort((distance[1, tied], distance[0, tied]))[0]]
        temperatures[j], biases[j] = floor_t, floor_b = temps[pick], bias[pick]
    for j in range(len(seen), gamma):  # never verified: the last verified position's pair
        if seen:
            temperatures[j], biases[j] = temperatures[j - 1], biases[j - 1]
    return Sts(tuple(temperatures.tolist()), tuple(biases.tolist()), "survival")


def position_report(z, verified, accepted, temperatures, bins: int = 10, biases=None) -> dict:
    """Per-position metrics before (all T = 1, b = 0) and after calibration (an `Sts`, or
    temperatures and biases of the factor form); lists of length γ.

    None marks a position no round verified, and an AUC where every outcome was the same.
    """
    z, observed, outcome, sts = _check_scored(z, verified, accepted, temperatures, biases)
    gamma = z.shape[1]
    before, after = survival(z, np.ones(gamma)), survival(z, sts)
    keys = ("n", "ece_before", "ece_after", "ece_floor", "auc_before", "auc", "brier_before",
            "brier", "accept_rate")
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
        report["ece_floor"].append(ece_floor(a, bins))
        report["auc_before"].append(defined(auc(b, o)))
        report["auc"].append(defined(auc(a, o)))
        report["brier_before"].append(brier(b, o))
        report["brier"].append(brier(a, o))
        report["accept_rate"].append(float(o.mean()))
    seen = [j for j in range(gamma) if report["n"][j]]
    for when in ("before", "after", "floor"):
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


def _check_biases(where: str, biases, count: int) -> tuple[float, ...]:
    """One error for a bias list of the wrong length or an entry that is not a finite number."""
    if not isinstance(biases, (list, tuple, np.ndarray)):
        raise CalibrationError(f"{where}: \"biases\" must be a list of numbers; "
                               f"found {type(biases).__name__}")
    if len(biases) != count:
        raise CalibrationError(f"{where}: {len(biases)} biases for {count} temperatures")
    out = []
    for j, b in enumerate(biases, start=1):
        if isinstance(b, bool) or not isinstance(b, (int, float, np.integer, np.floating)) \
                or not math.isfinite(b):
            raise CalibrationError(f"{where}: bias {j} is {b!r}; expected a finite number")
        out.append(float(b))
    return tuple(out)


def save_sts(path, calibration, **metadata) -> Path:
    """Writes an `Sts` (or temperatures [γ], biases 0) as JSON {"format": "dspark-sts", "version": 3,
    "block_size": γ, "form": "factor" | "survival", "temperatures": [...], "biases": [...],
    **metadata}."""
    path = Path(path)
    cal = calibration if isinstance(calibration, Sts) else None
    temps = _check_temperatures(str(path), cal.temperatures if cal else calibration)
    biases = _check_biases(str(path), cal.biases, len(temps)) if cal else (0.0,) * len(temps)
    form = cal.form if cal else "factor"
    check_form(str(path), form, temps, biases)
    reserved = sorted(set(metadata) & {"format", "version", "block_size", "form", "temperatures",
                                       "biases"})
    if reserved:
        raise CalibrationError(f"{path}: metadata may not set {reserved}; "
                               "those keys are written by save_sts")
    data = {"format": FORMAT, "version": VERSION, "block_size": len(temps), "form": form,
            "temperatures": list(temps), "biases": list(biases), **metadata}
    text = json.dumps(data, indent=2) + "\n"
    # Write then rename, so a reader never sees half a file next to a checkpoint.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def load_sts(path, block_size: int) -> Sts:
    """Reads and checks the calibration file of a drafter of this block size (a version 1 file has
    no biases: they are 0)."""
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
    if data.get("version", VERSION) not in (1, 2, VERSION):
        raise CalibrationError(f"{path}: version {data['version']!r}; "
                               f"this build reads versions 1 to {VERSION}")
    if "temperatures" not in data:
        raise CalibrationError(f"{path}: \"temperatures\" is missing; expected a list of numbers")
    temps = _check_temperatures(str(path), data["temperatures"])
    if "block_size" in data and data["block_size"] != len(temps):
        raise CalibrationError(f"{path}: \"block_size\" is {data['block_size']!r} but \"temperatures\" "
                               f"has {len(temps)} entries")
    if len(temps) != block_size:
        raise CalibrationError(f"{path}: {len(temps)} temperatures for a drafter with block size "
                               f"{block_size}; was it fitted for another drafter?")
    biases = _check_biases(str(path), data["biases"], len(temps)) if "biases" in data \
        else (0.0,) * len(temps)
    form = data.get("form", "factor")
    check_form(str(path), form, temps, biases)
    return Sts(temps, biases, form)


def check_form(where: str, form, temperatures, biases) -> None:
    """One error for an unknown form, or a survival-form calibration whose a_j could exceed 1 or
    rise along the block (b_1 > 0, b_j > b_{j-1} or T_j > T_{j-1}; positions are 1-based)."""
    if form not in FORMS:
        raise CalibrationError(f"{where}: \"form\" is {form!r}; expected one of {list(FORMS)}")
    if form != "survival":
        return
    for j in range(len(temperatures)):
        b_prev = biases[j - 1] if j else 0.0
        if biases[j] > b_prev:
            raise CalibrationError(
                f"{where}: survival form, bias {j + 1} is {biases[j]!r} > {b_prev!r} (bias {j} or 0): "
                "the biases must be <= 0 and non-increasing, or a_j could exceed 1 or rise along j")
        if j and temperatures[j] > temperatures[j - 1]:
            raise CalibrationError(
                f"{where}: survival form, temperature {j + 1} is {temperatures[j]!r} > "
                f"temperature {j} {temperatures[j - 1]!r}: the temperatures must be non-increasing, "
                "or a_j could rise along j")



# ---------------------------------------------------------------------------------------------
# Reliability diagram


def reliability_diagram(z, verified, accepted, temperatures, path, bins: int = 10,
                        title: str = "", biases=None) -> Path:
    """Writes a PNG: per position, observed prefix acceptance against mean predicted survival per
    score bin, raw (T = 1, b = 0) and calibrated (an `Sts`, or temperatures and biases). Bins of under 10 rounds are not drawn; ECE
    counts them."""
    # The Figure API with an explicit Agg canvas leaves pyplot's global backend and state alone,
    # and keeps matplotlib out of the import path of the engine.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    z, observed, outcome, sts = _check_scored(z, verified, accepted, temperatures, biases)
    temperatures, biases = sts.temperatures, sts.biases
    gamma = z.shape[1]
    curves = {"raw": survival(z, np.ones(gamma)), "STS": survival(z, sts)}

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
        shift = f", b={biases[j]:+.2f}" if biases[j] else ""
        ax.set_title(f"position {j + 1}  (T={temperatures[j]:.3g}{shift})", fontsize=9)
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
    """A calibration fitted on some requests' rounds and measured on the others'."""

    sts: Sts
    report: dict  # position_report on the held-out rounds
    held_out: tuple[np.ndarray, np.ndarray, np.ndarray]  # (z, ℓ, k) of the held-out rounds
    prompts_fit: int
    prompts_eval: int
    fit_rounds: int


def fit_on_results(results, *, eval_fraction: float = 0.3, seed: int = 0, bins: int = 10,
                   method: str = METHODS[0], prompt_of=None) -> Fitted:
    """Splits the prompts at random (`seed`), fits `method` (`METHODS`) on the rounds of
    1 - eval_fraction of them and reports on the rounds of the rest. `prompt_of(result)` names
    the prompt a result decoded (None: one result per prompt); the results of one prompt (several
    samples of it) all fall on the same side, so that the held-out figures measure prompts the
    fit has not seen."""
    if method not in METHODS:
        raise CalibrationError(f"calibration method {method!r}: expected one of {list(METHODS)}")
    keys = list(range(len(results))) if prompt_of is None else [prompt_of(r) for r in results]
    prompts = list(dict.fromkeys(keys))
    order = np.random.default_rng(seed).permutation(len(prompts))
    n_eval = max(1, int(round(eval_fraction * len(prompts))))
    held_keys = {prompts[i] for i in order[:n_eval]}
    held = [r for r, key in zip(results, keys) if key in held_keys]
    fit = [r for r, key in zip(results, keys) if key not in held_keys]
    z_fit, ell_fit, k_fit = stack_rounds(fit)
    evaluated = stack_rounds(held)
    if not len(z_fit) or not len(evaluated[0]):
        raise DSparkError("no decoding rounds with drafts to fit or to measure on (prompts too "
                          "short, or too few new tokens)")
    if method == "sts":
        sts = Sts.of(fit_sts(z_fit, ell_fit, k_fit, bins=bins))
    elif method == "sts-rank":
        sts = fit_sts_rank(z_fit, ell_fit, k_fit, bins=bins)
    else:
        grid, bias_grid = bias_grids()
        sts = fit_sts(z_fit, ell_fit, k_fit, grid=grid, bins=bins, bias_grid=bias_grid)
    report = position_report(*evaluated, sts, bins=bins)
    return Fitted(sts, report, evaluated, len(prompts) - n_eval, n_eval, len(z_fit))
