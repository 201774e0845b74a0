"""Request streams for the serving benchmark: Katz and GenTD26 traces replayed on the
catalog by popularity, nostall's own CSV by name, Zipf/Poisson draws with a burst;
a malformed row is refused naming the file, the row and the field."""

from __future__ import annotations

import itertools
import json
import statistics
from collections import Counter

import pytest

from nostall.bench.workload import Arrival, draw, read_trace, scale_to_rate
from nostall.errors import ArgumentError

CATALOG = ["flux", "sdxl", "sd3"]


def test_draws_follow_zipf_popularity_and_poisson_arrivals():
    s = draw(CATALOG, 30_000, rate=4.0, alpha=1.0, seed=1)
    counts = Counter(a.model for a in s)
    # Zipf(1): the k-th model is asked for in proportion to 1/k.
    assert counts["flux"] / counts["sdxl"] == pytest.approx(2.0, rel=0.05)
    assert counts["flux"] / counts["sd3"] == pytest.approx(3.0, rel=0.07)
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(s)]
    assert min(gaps) > 0
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: sd = mean
    uniform = Counter(a.model for a in draw(CATALOG, 30_000, rate=1.0, alpha=0.0, seed=2))
    assert max(uniform.values()) / min(uniform.values()) < 1.05
    assert draw(CATALOG, 50, rate=1.0, seed=3) == draw(CATALOG, 50, rate=1.0, seed=3)
    assert draw(CATALOG, 50, rate=1.0, seed=3) != draw(CATALOG, 50, rate=1.0, seed=4)


def test_a_burst_multiplies_the_rate_while_it_lasts():
    s = draw(CATALOG, 4000, rate=2.0, seed=5, burst_at_s=100.0, burst_s=20.0, burst_x=20.0)
    inside = [a for a in s if 100.0 <= a.at_s < 120.0]
    before = [a for a in s if 50.0 <= a.at_s < 100.0]
    assert len(before) / 50.0 == pytest.approx(2.0, rel=0.2)
    assert len(inside) / 20.0 == pytest.approx(40.0, rel=0.1)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"n": -1, "rate": 1.0}, "n=-1 must be a number of requests"),
        ({"n": 3, "rate": 0.0}, "rate=0.0 must be a finite number > 0"),
        ({"n": 3, "rate": 1.0, "alpha": -1.0}, "alpha=-1.0"),
        ({"n": 3, "rate": 1.0, "burst_x": float("inf")}, "burst_x=inf"),
    ],
)
def test_bad_draws_are_refused_naming_the_value(kwargs, says):
    with pytest.raises(ArgumentError, match=says.replace("(", r"\(").replace(".", r"\.")):
        draw(CATALOG, **kwargs)
    with pytest.raises(ArgumentError, match="must name at least one catalog pipeline"):
        draw([], 3, rate=1.0)


def test_a_katz_trace_is_replayed_on_the_catalog_by_popularity(tmp_path):
    reqs = [
        {"timestamp": "2024-03-01 10:00:05", "ip": "a", "scene_id": "A", "base_model_id": "b7",
         "controlnets": ["c1"], "loras": ["l1", "l2"]},
        {"timestamp": "2024-03-01 10:00:00", "ip": "a", "scene_id": "A", "base_model_id": "b3",
         "controlnets": None, "loras": None},
        {"timestamp": "2024-03-01 10:00:09", "ip": "b", "scene_id": "B", "base_model_id": "b3",
         "controlnets": [], "loras": ["l1"]},
        {"timestamp": "2024-03-01 10:00:02", "ip": "b", "scene_id": "A", "base_model_id": None,
         "controlnets": [], "loras": []},
        {"timestamp": "2024-03-01 10:00:07", "ip": "b", "scene_id": "A", "base_model_id": "b9",
         "controlnets": [], "loras": []},
        {"timestamp": "2024-03-01 10:00:08", "ip": "b", "scene_id": "A", "base_model_id": "b8",
         "controlnets": [], "loras": []},
    ]  # fmt: skip
    path = tmp_path / "diffusion_model_request_trace.json"
    path.write_text(json.dumps(reqs))
    s = read_trace(path, CATALOG)
    # time order, the first at 0; b3 (twice) is the most asked for, then b7, b8, b9 by id;
    # the request with no base model is left out, as the trace's own analysis does.
    assert [(a.at_s, a.source, a.model) for a in s] == [
        (0.0, "b3", "flux"),
        (5.0, "b7", "sdxl"),
        (7.0, "b9", "flux"),  # a fourth model folds back onto the first
        (8.0, "b8", "sd3"),
        (9.0, "b3", "flux"),
    ]
    assert s[1].loras == ("l1", "l2") and s[1].controlnets == ("c1",) and s[1].row == 1
    assert [a.at_s for a in read_trace(path, CATALOG, limit=2)] == [0.0, 5.0]


def test_a_gentd26_trace_keeps_steps_images_and_leaves_failed_requests_out(tmp_path):
    header = (
        "gmt_create,predict_type,predict_status,exec_time_seconds,groupId,prompt_length,"
        "negative_prompt_length,num_images_per_prompt,num_inference_steps,"
        "checkpoint_model_version_id,num_lora"
    )
    rows = [
        "2024-11-15 16:57:50,TXT_2_IMG,SUCCEED,32.0,G1,63.0,26.0,1.0,30.0,M7,0",
        "2024-11-15 16:58:00,IMG_2_IMG,FAILED,3.0,G1,63.0,,2.0,30.0,M9,0",
        "2024-11-15 16:58:20,TXT_2_IMG,SUCCEED,12.0,G2,10.0,,8.0,40.0,M7,2",
        "2024-11-15 16:59:50,INPAINTING,SUCCEED,9.0,G2,12.0,,4.0,25.0,M5,1",
    ]
    path = tmp_path / "lora_request_trace.csv"
    path.write_text("\n".join([header, *rows]) + "\n")
    s = read_trace(path, CATALOG)
    assert [(a.at_s, a.source, a.model, a.steps, a.images, len(a.loras)) for a in s] == [
        (0.0, "M7", "flux", 30, 1, 0),
        (30.0, "M7", "flux", 40, 8, 2),
        (120.0, "M5", "sdxl", 25, 4, 1),
    ]
    assert [a.row for a in s] == [2, 4, 5]


def test_nostalls_csv_names_catalog_models_and_an_unknown_one_is_refused_by_row(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("at_s,model,steps,loras\n0.5,sdxl,8,a;b\n0.0,flux,,\n")
    s = read_trace(path, CATALOG, mapping="names")
    assert [(a.at_s, a.model, a.steps, a.loras) for a in s] == [
        (0.0, "flux", None, ()),
        (0.5, "sdxl", 8, ("a", "b")),
    ]
    path.write_text("at_s,model\n0.0,flux\n1.0,flux-dev\n")
    with pytest.raises(ArgumentError, match=r"row 3 asks for model 'flux-dev'") as e:
        read_trace(path, CATALOG, mapping="names")
    assert e.value.field == "model" and e.value.allowed == CATALOG


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("at_s,model\n0,flux\nsoon,flux\n", r"row 3: at_s 'soon' is not a time"),
        ("at_s,model,steps\n0,flux,7.5\n", r"row 2: steps '7\.5' is not a whole number >= 1"),
        ("at_s,model\n0,flux,extra\n", "row 2 has more fields than the header"),
        ("at_s,model\n0,\n", "row 2: model is empty"),
        ("time,name\n0,flux\n", "needs the columns gmt_create and checkpoint_model_version_id"),
        ("at_s,model\n", "the trace holds no request"),
        ('{"requests": []}', "a Katz trace is a JSON list of requests"),
        ('[{"timestamp": 1, "base_model_id": "x", "loras": "l1"}]', "request 1: loras 'l1'"),
        ('[{"timestamp": true, "base_model_id": "x"}]', "request 1: timestamp True is not"),
        ("[1, 2", "not JSON"),
    ],
)
def test_a_malformed_trace_is_refused_naming_the_row_and_field(tmp_path, text, says):
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(ArgumentError, match=says) as e:
        read_trace(path, CATALOG)
    assert str(path) in str(e.value)
    with pytest.raises(ArgumentError, match="mapping='popular' is not one of rank, names"):
        read_trace(path, CATALOG, mapping="popular")
    with pytest.raises(ArgumentError, match="cannot read the trace"):
        read_trace(tmp_path / "missing.json", CATALOG)


def test_timestamps_in_seconds_milliseconds_and_iso_dates_agree(tmp_path):
    base = 1_700_000_000
    for stamps in ([base, base + 2], [base * 1000, (base + 2) * 1000], ["2023-11-14T22:13:20Z",
                   "2023-11-14T22:13:22+00:00"]):  # fmt: skip
        reqs = [{"timestamp": t, "base_model_id": "m"} for t in stamps]
        path = tmp_path / "k.json"
        path.write_text(json.dumps(reqs))
        assert [a.at_s for a in read_trace(path, CATALOG)] == [0.0, 2.0]


def test_scaling_a_trace_to_a_rate_keeps_its_shape():
    s = [Arrival(t, "flux") for t in (10.0, 11.0, 11.5, 20.0, 30.0)]
    out = scale_to_rate(s, 2.0)
    assert out[0].at_s == 0.0
    assert (len(out) - 1) / out[-1].at_s == pytest.approx(2.0)
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(out)]
    assert gaps[0] / gaps[1] == pytest.approx(2.0) and gaps[3] / gaps[2] == pytest.approx(10 / 8.5)
    assert scale_to_rate(s[:1], 2.0)[0].at_s == 0.0
    with pytest.raises(ArgumentError, match="rate=0 must be"):
        scale_to_rate(s, 0)
