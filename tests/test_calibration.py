"""Sequential Temperature Scaling: metrics against scipy and by hand, recovery of known temperatures
on a simulated accept chain, the calibration file's errors, and the reliability diagram."""

import json
import math
import re

import numpy as np
import pytest
from scipy.stats import mannwhitneyu

from dspark_jax.decoding.calibration import (
    CalibrationError,
    Sts,
    auc,
    bias_grids,
    brier,
    ece,
    fit_on_results,
    fit_sts,
    fit_sts_rank,
    load_sts,
    observations,
    position_report,
    reliability_diagram,
    save_sts,
    survival,
)

T_STAR = np.array([2.0, 0.7, 1.5, 3.0])


def simulate(rng, n, temperatures=T_STAR, short_share=0.2, max_verified=None, biases=0.0):
    """Rounds of a drafter whose true conditional acceptance is σ(z_j / T*_j + b*_j).
    Returns z [n, γ], ℓ [n], k [n]; a `short_share` of rounds verify fewer than γ drafts."""
    gamma = len(temperatures)
    z = rng.normal(1.5, 2.0, (n, gamma))
    ok = rng.random((n, gamma)) < 1.0 / (1.0 + np.exp(-(z / temperatures + biases)))
    leading = np.cumprod(ok, axis=1).sum(axis=1)  # accepted until the first rejection
    verified = np.full(n, gamma if max_verified is None else max_verified)
    short = rng.random(n) < short_share
    verified[short] = rng.integers(0, verified[short])
    verified = np.minimum(verified, gamma)
    return z, verified, np.minimum(leading, verified)


# --- metrics ---------------------------------------------------------------------------------


def test_ece_calibrated_vs_overconfident():
    rng = np.random.default_rng(0)
    scores = rng.random(200_000)
    assert ece(scores, rng.random(scores.size) < scores) < 0.005
    z = rng.normal(0.0, 3.0, 200_000)
    outcomes = rng.random(z.size) < 1.0 / (1.0 + np.exp(-z / 2.0))
    assert ece(1.0 / (1.0 + np.exp(-z)), outcomes) > 0.03


def test_ece_by_hand():
    # Bins 0, 1 and 9 (1.0 joins the last bin): (0.05 + 0.15 + 2 * |0.975 - 1|) / 4.
    assert ece([0.05, 0.15, 1.0, 0.95], [0, 0, 1, 1]) == pytest.approx(0.0625)
    assert ece([0.3, 0.7], [1, 0], bins=1) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="no scores"):
        ece([], [])


@pytest.mark.parametrize("seed", range(4))
def test_auc_matches_mann_whitney_with_ties(seed):
    rng = np.random.default_rng(seed)
    scores = np.round(rng.random(500), 1)  # eleven distinct values: many ties
    outcomes = rng.random(500) < scores
    pos, neg = scores[outcomes], scores[~outcomes]
    expected = mannwhitneyu(pos, neg).statistic / (pos.size * neg.size)
    assert auc(scores, outcomes) == pytest.approx(expected, abs=1e-12)


def test_auc_by_hand_and_one_class():
    assert auc([0.1, 0.4, 0.4, 0.9], [0, 0, 1, 1]) == pytest.approx(0.875)  # one tie counted half
    assert math.isnan(auc([0.2, 0.8], [1, 1]))
    assert math.isnan(auc([0.2, 0.8], [0, 0]))


def test_brier():
    assert brier([0.0, 0.5, 1.0], [0, 1, 1]) == pytest.approx(0.25 / 3)


# --- survival and observations -------------------------------------------------------------------


def test_survival_matches_cumprod_and_is_stable():
    rng = np.random.default_rng(1)
    z = rng.normal(0.0, 2.0, (50, 5))
    t = np.array([0.5, 1.0, 2.0, 3.0, 0.8])
    np.testing.assert_allclose(survival(z, t), np.cumprod(1.0 / (1.0 + np.exp(-z / t)), axis=-1),
                               rtol=1e-12)
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # underflow to 0 is fine
        extreme = survival(np.array([[-2000.0, 3.0], [2000.0, 2000.0]]), [0.05, 1.0])
    assert extreme.dtype == np.float64
    np.testing.assert_allclose(extreme, [[0.0, 0.0], [1.0, 1.0]])


def test_observations():
    observed, outcome = observations(np.array([0, 2, 3]), np.array([0, 1, 3]), gamma=3)
    np.testing.assert_array_equal(observed, [[0, 0, 0], [1, 1, 0], [1, 1, 1]])
    np.testing.assert_array_equal(outcome, [[0, 0, 0], [1, 0, 0], [1, 1, 1]])


# --- fitting ------------------------------------------------------------------------------------


def test_fit_sts_recovers_known_temperatures():
    rng = np.random.default_rng(0)
    fitted = fit_sts(*simulate(rng, 60_000))
    np.testing.assert_allclose(fitted, T_STAR, rtol=0.15)

    held_out = simulate(rng, 30_000)
    report = position_report(*held_out, fitted)
    assert report["n"][0] == 30_000 - np.sum(held_out[1] == 0)
    assert report["mean_ece_after"] < 0.015
    assert report["mean_ece_after"] < 0.3 * report["mean_ece_before"]
    assert all(a < b for a, b in zip(report["ece_after"], report["ece_before"]))
    assert all(a < b for a, b in zip(report["brier"], report["brier_before"]))
    # Position 1 is one monotone map: the ranking is identical. Later positions multiply factors
    # scaled differently, so the ranking moves a little, here towards the true probabilities'.
    assert report["auc"][0] == pytest.approx(report["auc_before"][0], abs=1e-12)
    oracle = position_report(*held_out, T_STAR)
    for after, before, best in zip(report["auc"], report["auc_before"], oracle["auc"]):
        assert abs(after - before) < 0.02
        assert after == pytest.approx(best, abs=0.002)


B_STAR = np.array([-1.0, 0.5, -0.8, 1.2])


def test_bias_method_recovers_a_shifted_head_that_temperatures_cannot():
    # Confidences off by a constant per position: temperatures alone leave most of the error,
    # the bias method finds the shift (within the grid's 0.05 steps) and the ranking stays.
    rng = np.random.default_rng(3)
    t_true = np.array([1.2, 0.8, 1.5, 1.0])
    grid, bias_grid = bias_grids()
    fitting = simulate(rng, 20_000, t_true, biases=B_STAR)
    fitted = fit_sts(*fitting, grid=grid, bias_grid=bias_grid)
    assert isinstance(fitted, Sts)
    np.testing.assert_allclose(fitted.biases, B_STAR, atol=0.25)
    np.testing.assert_allclose(fitted.temperatures, t_true, rtol=0.25)
    held_out = simulate(rng, 10_000, t_true, biases=B_STAR)
    with_bias = position_report(*held_out, fitted.temperatures, biases=fitted.biases)
    temps_only = position_report(*held_out, fit_sts(*fitting))
    assert with_bias["mean_ece_after"] < 0.015
    assert with_bias["mean_ece_after"] < 0.5 * temps_only["mean_ece_after"]
    # As for temperatures alone: the product's ranking moves towards the true probabilities'.
    oracle = position_report(*held_out, t_true, biases=B_STAR)
    for after, before, best in zip(with_bias["auc"], with_bias["auc_before"], oracle["auc"]):
        assert abs(after - before) < 0.03
        assert after == pytest.approx(best, abs=0.003)


def test_rank_method_keeps_every_positions_auc_and_calibrates():
    """sts-rank on an overconfident head (what the bundled drafter's is on new prompts): each
    position's held-out AUC is the raw one exactly (ties counted the same), the ECE falls to a
    fraction of the raw head's, and the calibrated survival is a probability that never rises
    along the block in any round."""
    rng = np.random.default_rng(3)
    t_true, b_true = np.array([1.2, 0.8, 1.5, 1.0]), np.array([-0.6, -1.0, -0.8, -1.2])
    fitting = simulate(rng, 20_000, t_true, biases=b_true)
    fitted = fit_sts_rank(*fitting)
    assert fitted.form == "survival"
    assert all(a >= b for a, b in zip(fitted.temperatures, fitted.temperatures[1:]))
    assert all(b <= 0 for b in fitted.biases)
    assert all(a >= b for a, b in zip(fitted.biases, fitted.biases[1:]))
    held_out = simulate(rng, 10_000, t_true, biases=b_true)
    report = position_report(*held_out, fitted)
    assert report["auc"] == report["auc_before"]
    assert report["mean_ece_after"] < 0.25 * report["mean_ece_before"]
    a = survival(held_out[0], fitted)
    assert np.all((a >= 0) & (a <= 1)) and np.all(np.diff(a, axis=1) <= 0)
    # Extreme logits: still a probability, still never rising, ranks kept.
    z = np.array([[-2000.0, 3.0, 40.0, -40.0], [2000.0, 2000.0, 2000.0, 2000.0]])
    extreme = survival(z, fitted)
    assert np.all(np.isfinite(extreme)) and np.all(np.diff(extreme, axis=1) <= 0)


def test_rank_method_finds_the_least_ece_sum_under_its_constraints():
    """The dynamic programme against brute force over every constrained choice on a small grid:
    the same least sum of the positions' ECEs on the fit rounds (a position-by-position search
    misses it here: position 1 alone would take a pair that rules out what later ones need)."""
    import itertools

    rng = np.random.default_rng(5)
    z, verified, accepted = simulate(rng, 3_000, np.array([0.7, 2.0, 2.0]),
                                     biases=np.array([-0.5, 0.5, 0.5]))
    observed, outcome = observations(verified, accepted, 3)
    grid, bias_grid = np.array([0.5, 0.8, 1.25, 2.0]), np.array([-1.5, -0.75, -0.25, 0.0])
    pairs = list(itertools.product(grid, bias_grid))

    def position_ece(j, pair):  # position j's ECE depends on its own pair only
        a = survival(z, Sts((pair[0],) * 3, (pair[1],) * 3, "survival"))[:, j]
        return ece(a[observed[:, j]], outcome[observed[:, j], j])

    table = {(j, pair): position_ece(j, pair) for j in range(3) for pair in pairs}
    best = min(sum(table[j, pair] for j, pair in enumerate(chain))
               for chain in itertools.product(pairs, repeat=3)
               if all(a[0] >= b[0] and a[1] >= b[1] for a, b in zip(chain, chain[1:])))
    fitted = fit_sts_rank(z, verified, accepted, grid=grid, bias_grid=bias_grid)
    chosen = list(zip(fitted.temperatures, fitted.biases))
    assert sum(table[j, pair] for j, pair in enumerate(chosen)) == pytest.approx(best, abs=1e-12)
    greedy, floor = 0.0, (np.inf, 0.0)  # position by position, as the factor form is fitted
    for j in range(3):
        floor = min((p for p in pairs if p[0] <= floor[0] and p[1] <= floor[1]),
                    key=lambda p: table[j, p])
        greedy += table[j, floor]
    assert greedy > best + 1e-3


def test_rank_method_keeps_its_predecessor_where_nothing_was_verified():
    rng = np.random.default_rng(4)
    z, verified, accepted = simulate(rng, 4_000, T_STAR, max_verified=2, short_share=0.0)
    fitted = fit_sts_rank(z, verified, accepted)
    assert fitted.temperatures[2:] == (fitted.temperatures[1],) * 2
    assert fitted.biases[2:] == (fitted.biases[1],) * 2
    with pytest.raises(CalibrationError, match="sts-rank's bias grid must be finite numbers <= 0"):
        fit_sts_rank(z, verified, accepted, bias_grid=[0.0, 0.5])


def test_bias_method_ties_go_to_identity():
    grid, bias_grid = bias_grids()
    z = np.zeros((200, 2))  # every round accepted once in two: T = 1, b = 0 is exact
    fitted = fit_sts(z, np.full(200, 1), np.arange(200) % 2, grid=grid, bias_grid=bias_grid)
    assert fitted.temperatures[0] == 1.0 and fitted.biases[0] == 0.0
    assert fitted.temperatures[1] == 1.0 and fitted.biases[1] == 0.0  # never verified


def test_fit_on_results_methods():
    class Res:  # what the engine's results carry for calibration
        def __init__(self, z, ell, k):
            self.conf_logits, self.verified, self.drafts_accepted = z.tolist(), ell.tolist(), k.tolist()

    rng = np.random.default_rng(4)
    z, ell, k = simulate(rng, 6_000, biases=B_STAR)
    results = [Res(z[i::20], ell[i::20], k[i::20]) for i in range(20)]
    plain = fit_on_results(results, method="sts")
    assert plain.sts.biases == (0.0,) * 4
    biased = fit_on_results(results)  # the default
    assert any(b != 0 for b in biased.sts.biases)
    assert biased.report["mean_ece_after"] < plain.report["mean_ece_after"]
    ranked = fit_on_results(results, method="sts-rank")
    assert ranked.sts.form == "survival" and ranked.report["auc"] == ranked.report["auc_before"]
    with pytest.raises(CalibrationError, match="calibration method 'platt'"):
        fit_on_results(results, method="platt")


def test_fit_on_results_keeps_the_samples_of_a_prompt_together():
    class Res:  # one sample of one prompt; its logits carry prompt + sample / 10 as a marker
        def __init__(self, prompt, sample):
            self.id = f"p{prompt}#{sample}"
            self.conf_logits = [[prompt + sample / 10, 0.0]] * 5
            self.verified, self.drafts_accepted = [2] * 5, [sample % 2] * 5

    results = [Res(p, k) for k in range(3) for p in range(10)]  # the samples interleaved
    fitted = fit_on_results(results, prompt_of=lambda r: r.id.rsplit("#", 1)[0])
    assert (fitted.prompts_fit, fitted.prompts_eval) == (7, 3)
    markers = set(np.round(fitted.held_out[0][:, 0], 3))
    held = {int(m) for m in markers}
    assert len(held) == 3 and markers == {round(p + k / 10, 3) for p in held for k in range(3)}
    assert fitted.fit_rounds == 7 * 3 * 5 and len(fitted.held_out[0]) == 3 * 3 * 5
    # one result per prompt (the default) splits the 30 results themselves
    alone = fit_on_results(results)
    assert (alone.prompts_fit, alone.prompts_eval) == (21, 9)


def test_unobserved_position_keeps_identity():
    rng = np.random.default_rng(2)
    z, verified, accepted = simulate(rng, 5_000, max_verified=2)  # drafts 3 and 4 never verified
    fitted = fit_sts(z, verified, accepted)
    assert fitted[2] == 1.0 and fitted[3] == 1.0
    assert fitted[0] != 1.0
    report = position_report(z, verified, accepted, fitted)
    assert report["n"][2:] == [0, 0]
    for key in ("ece_before", "ece_after", "auc_before", "auc", "brier", "brier_before", "accept_rate"):
        assert report[key][2:] == [None, None], key
    assert report["mean_ece_after"] == pytest.approx(np.mean(report["ece_after"][:2]))


def test_ties_go_to_identity():
    # σ(0 / T) = 1/2 for every T: every grid point has the same ECE.
    z = np.zeros((100, 2))
    fitted = fit_sts(z, np.full(100, 2), np.arange(100) % 3)
    np.testing.assert_array_equal(fitted, [1.0, 1.0])


@pytest.mark.parametrize("verified, accepted, match", [
    ([2, 5], [0, 0], r"round 1: verified ℓ=5, accepted k=0; expected 0 <= k <= ℓ <= γ=3"),
    ([2, 1], [0, 2], r"round 1: verified ℓ=1, accepted k=2"),
    ([2, 1, 0], [0, 0, 0], r"2 rounds of logits but verified has shape \(3,\)"),
])
def test_fit_sts_rejects_bad_records(verified, accepted, match):
    with pytest.raises(CalibrationError, match=match):
        fit_sts(np.zeros((2, 3)), np.array(verified), np.array(accepted))


def test_fit_sts_rejects_bad_grid_and_logits():
    with pytest.raises(CalibrationError, match="grid must be finite numbers > 0"):
        fit_sts(np.zeros((2, 3)), np.array([1, 1]), np.array([0, 1]), grid=[0.5, 0.0])
    with pytest.raises(CalibrationError, match="round 1: confidence logits are not finite"):
        fit_sts(np.array([[0.0], [np.nan]]), np.array([1, 1]), np.array([0, 1]))
    with pytest.raises(CalibrationError, match=r"\[rounds, γ\] with γ >= 1; got shape \(2,\)"):
        fit_sts(np.zeros(2), np.array([1, 1]), np.array([0, 1]))


# --- the calibration file ---------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    path = save_sts(tmp_path / "sts.json", np.array([2.0, 0.7, 1.5, 3.0]), drafter="step_1000",
                    ece_after=[0.01, 0.02])
    data = json.loads(path.read_text())
    assert data["format"] == "dspark-sts" and data["version"] == 3 and data["block_size"] == 4
    assert data["form"] == "factor"
    assert data["drafter"] == "step_1000"
    assert load_sts(path, block_size=4) == Sts((2.0, 0.7, 1.5, 3.0), (0.0,) * 4)
    cal = Sts((2.0, 0.7, 1.5, 3.0), (0.5, -1.0, 0.0, 2.25))
    save_sts(tmp_path / "again.json", cal)
    assert load_sts(tmp_path / "again.json", 4) == cal
    # A version 1 file (temperatures only) still loads, with biases 0.
    old = _write(tmp_path / "v1.json", {"format": "dspark-sts", "version": 1, "temperatures": [1.0, 2.0]})
    assert load_sts(old, 2) == Sts((1.0, 2.0), (0.0, 0.0))
    ranked = Sts((2.0, 2.0, 1.5, 0.5), (0.0, -0.5, -0.5, -2.25), "survival")
    save_sts(tmp_path / "rank.json", ranked)
    assert json.loads((tmp_path / "rank.json").read_text())["form"] == "survival"
    assert load_sts(tmp_path / "rank.json", 4) == ranked


def _write(path, payload):
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return path


GOOD = {"format": "dspark-sts", "version": 1, "block_size": 4, "temperatures": [1.0, 2.0, 0.5, 1.5]}


@pytest.mark.parametrize("payload, match", [
    ('{"format": "dspark-sts",\n "temperatures": [1.0,]}', r"not valid JSON \(line 2, column"),
    ([1.0, 2.0], r"expected a JSON object, found list"),
    ({**GOOD, "format": None}, r"\"format\" is None; expected \"dspark-sts\""),
    ({k: v for k, v in GOOD.items() if k != "format"},
     r"\"format\" is missing; expected \"dspark-sts\""),
    ({**GOOD, "format": "dflash-sts"}, r"\"format\" is 'dflash-sts'; expected \"dspark-sts\""),
    ({**GOOD, "version": 4}, r"version 4; this build reads versions 1 to 3"),
    ({**GOOD, "form": "prefix"}, r"\"form\" is 'prefix'; expected one of \['factor', 'survival'\]"),
    ({**GOOD, "form": "survival", "temperatures": [2.0, 1.0, 1.5, 1.0]},
     r"survival form, temperature 3 is 1.5 > temperature 2 1.0: the temperatures must be "
     r"non-increasing"),
    ({**GOOD, "form": "survival", "temperatures": [1.0] * 4, "biases": [0.5, 0.0, 0.0, 0.0]},
     r"survival form, bias 1 is 0.5 > 0.0 \(bias 0 or 0\): the biases must be <= 0"),
    ({**GOOD, "form": "survival", "temperatures": [1.0] * 4, "biases": [-1.0, -2.0, -1.5, -3.0]},
     r"survival form, bias 3 is -1.5 > -2.0"),
    ({**GOOD, "biases": [0.0, 1.0]}, r"2 biases for 4 temperatures"),
    ({**GOOD, "biases": "0 0 0 0"}, r"\"biases\" must be a list of numbers; found str"),
    ('{"format": "dspark-sts", "temperatures": [1, 1, 1, 1], "biases": [0, NaN, 0, 0]}',
     r"bias 2 is nan; expected a finite number"),
    ({k: v for k, v in GOOD.items() if k != "temperatures"}, r"\"temperatures\" is missing"),
    ({**GOOD, "temperatures": "1.0 2.0"}, r"\"temperatures\" must be a list of numbers; found str"),
    ({**GOOD, "temperatures": [1.0, "2", 0.5, 1.5]}, r"temperature 2 is '2'; expected a number"),
    ({**GOOD, "temperatures": [1.0, 2.0, True, 1.5]}, r"temperature 3 is True; expected a number"),
    ({**GOOD, "temperatures": [1.0, 2.0, 0.5, -1.5]},
     r"temperature 4 is -1.5; expected a finite number > 0"),
    ({**GOOD, "temperatures": [0, 2.0, 0.5, 1.5]}, r"temperature 1 is 0; expected a finite number > 0"),
    ('{"format": "dspark-sts", "temperatures": [1.0, NaN, 1.0, 1.0]}', r"temperature 2 is nan"),
    ('{"format": "dspark-sts", "temperatures": [1.0, 1.0, Infinity, 1.0]}', r"temperature 3 is inf"),
    ({**GOOD, "block_size": 5}, r"\"block_size\" is 5 but \"temperatures\" has 4 entries"),
    ({**GOOD, "block_size": 5, "temperatures": [1.0] * 5},
     r"5 temperatures for a drafter with block size 4; was it fitted for another drafter\?"),
])
def test_load_sts_errors_name_the_file_and_problem(tmp_path, payload, match):
    path = _write(tmp_path / "sts.json", payload)
    with pytest.raises(CalibrationError, match=f"^{re.escape(str(tmp_path / 'sts.json'))}: {match}"):
        load_sts(path, block_size=4)


def test_load_sts_missing_file(tmp_path):
    missing = re.escape(str(tmp_path / "nope.json"))
    with pytest.raises(CalibrationError, match=f"^{missing}: no such STS calibration file"):
        load_sts(tmp_path / "nope.json", 4)
    with pytest.raises(CalibrationError, match="no such STS calibration file"):
        load_sts(tmp_path, 4)  # a directory is not a calibration file


def test_save_sts_rejects_bad_temperatures_and_reserved_keys(tmp_path):
    with pytest.raises(CalibrationError, match=r"sts.json: temperature 2 is nan; expected a finite"):
        save_sts(tmp_path / "sts.json", [1.0, float("nan")])
    with pytest.raises(CalibrationError, match=r"metadata may not set \['block_size'\]"):
        save_sts(tmp_path / "sts.json", [1.0], block_size=2)
    assert not (tmp_path / "sts.json").exists()


# --- reliability diagram ---------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [4, 15])
def test_reliability_diagram_writes_png(tmp_path, gamma):
    rng = np.random.default_rng(gamma)
    temperatures = np.linspace(0.7, 3.0, gamma)
    z, verified, accepted = simulate(rng, 4_000, temperatures=temperatures, max_verified=gamma - 1)
    fitted = fit_sts(z, verified, accepted)
    path = reliability_diagram(z, verified, accepted, fitted, tmp_path / "reliability.png",
                               title=f"γ={gamma}")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


def test_ece_floor_is_what_a_calibrated_head_shows_on_so_many_rounds():
    """All scores 1/2 (one bin): the floor is E|mean of n fair coins - 1/2| = sqrt(2/pi) x 1/(2 sqrt n),
    it halves when the rounds quadruple, and certain scores (0 and 1) leave no sampling error."""
    from dspark_jax.decoding.calibration import ece_floor

    for n in (100, 400, 1600):
        expected = math.sqrt(2 / math.pi) * 0.5 / math.sqrt(n)
        assert ece_floor(np.full(n, 0.5), draws=2000) == pytest.approx(expected, rel=0.05)
    assert ece_floor(np.array([0.0, 1.0, 1.0, 0.0])) == 0.0
    # A head calibrated by construction measures about its floor, not zero.
    rng = np.random.default_rng(3)
    s = rng.uniform(0.05, 0.95, 900)
    measured = np.mean([ece(s, rng.random(900) < s) for _ in range(300)])
    assert measured == pytest.approx(ece_floor(s, draws=300), rel=0.1)
