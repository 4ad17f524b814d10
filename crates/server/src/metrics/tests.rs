use flint_engine::{CacheInfo, EngineStats, WorkerStatus};

use super::exposition::{parse, Exposition};
use super::fixture::{fixture, scrape};
use super::*;

/// What is in one exposition and not the other, one line each, for the failure message.
fn difference(want: &Exposition, got: &Exposition) -> String {
    let mut out = String::new();
    for (name, w) in &want.families {
        if got.families.get(name) != Some(w) {
            out += &format!("family {name}: want {w:?}, got {:?}\n", got.families.get(name));
        }
    }
    for name in got.families.keys().filter(|n| !want.families.contains_key(*n)) {
        out += &format!("family {name}: not wanted\n");
    }
    for s in want.samples.difference(&got.samples) {
        out += &format!("missing: {s:?}\n");
    }
    for s in got.samples.difference(&want.samples) {
        out += &format!("extra:   {s:?}\n");
    }
    out
}

fn parsed(text: &str) -> Exposition {
    parse(text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

/// The done-criterion: for the same state, `/metrics` says what the hand-written text said
/// (every family's name, type and help; every sample's name, labels and value).
#[test]
fn exposition_equals_the_hand_written_one() {
    let s = scrape();
    for (name, text) in [("metrics_before.txt", s.render()), ("metrics_before_loading.txt", s.render_loading())] {
        let (want, got) = (parsed(&fixture(name)), parsed(&text));
        assert!(want.samples.len() > 10, "{name}: the fixture has samples");
        assert!(want == got, "{name} differs:\n{}\n{text}", difference(&want, &got));
    }
}

/// The comparison above can fail: a changed label, label value, value, type, help or a lost
/// sample each make the fixture differ from itself.
#[test]
fn the_comparison_sees_each_kind_of_change() {
    let text = fixture("metrics_before.txt");
    let want = parsed(&text);
    assert!(want == parsed(&text));
    for (from, to) in [
        (
            "flint:worker_num_requests_running{model_name=\"org/demo-\\\"7b\\\"\\\\v1\",worker=\"cpu1\"} 4",
            "flint:worker_num_requests_running{model_name=\"org/demo-\\\"7b\\\"\\\\v1\",worker=\"cpu2\"} 4",
        ),
        (",worker=\"cpu0\"} 3", ",node=\"cpu0\"} 3"),
        ("finished_reason=\"length\"} 1", "finished_reason=\"length\"} 2"),
        ("# TYPE vllm:cache_config_info gauge", "# TYPE vllm:cache_config_info untyped"),
        (
            "# HELP vllm:num_preemptions_total Preemptions (recompute).",
            "# HELP vllm:num_preemptions_total Preemptions.",
        ),
        ("enable_prefix_caching=\"true\"", "enable_prefix_caching=\"True\""),
        ("le=\"0.000025\"} 1", "le=\"0.00003\"} 1"),
    ] {
        assert!(text.contains(from), "{from}");
        let changed = parsed(&text.replacen(from, to, 1));
        assert!(want != changed, "{from} -> {to} went unnoticed");
    }
    let dropped: String = text.lines().filter(|l| !l.contains("position=\"2\"")).map(|l| format!("{l}\n")).collect();
    assert!(want != parsed(&dropped), "a lost sample went unnoticed");
}

/// Prometheus reads a bucket bound as a number: the client's Go-style `2.5e-05` is the old
/// `0.000025`; a value's `1.0` is `1`. OpenMetrics' counter family names and `# EOF` read the same.
#[test]
fn numbers_and_formats_compare_as_a_scraper_reads_them() {
    let classic = "# HELP h_seconds H.\n# TYPE h_seconds histogram\nh_seconds_bucket{le=\"0.000025\"} 1\n\
                   h_seconds_bucket{le=\"+Inf\"} 1\nh_seconds_sum 1\nh_seconds_count 1\n\
                   # HELP c_total C.\n# TYPE c_total counter\nc_total{a=\"x\",b=\"y\"} 2\n";
    let open = "# HELP h_seconds H.\n# TYPE h_seconds histogram\nh_seconds_bucket{le=\"2.5e-05\"} 1\n\
                h_seconds_bucket{le=\"+Inf\"} 1.0\nh_seconds_sum 1.0\nh_seconds_count 1\n\
                # HELP c C.\n# TYPE c counter\nc_total{b=\"y\",a=\"x\"} 2\n# EOF\n";
    assert_eq!(parsed(classic), parsed(open));
    assert!(parse("# HELP x X.\n# TYPE x gauge\ny 1\n").is_err(), "a sample outside its family");
    assert!(parse("# HELP x X.\n# TYPE x gauge\nx 1\nx 2\n").is_err(), "a series twice");
}

/// Scrapers were told the classic text format before; they still are.
#[test]
fn content_type_is_the_classic_text_format() {
    assert_eq!(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8");
    let text = scrape().render();
    assert!(!text.contains("# EOF") && text.ends_with('\n'), "{text}");
}

#[test]
fn renders_vllm_names_and_histograms() {
    let m = Metrics::new("demo");
    m.ttft(0.03);
    m.ttft(3.0);
    m.finished("stop", 1.2);
    m.failed("overloaded");
    let cache = CacheInfo {
        dtype: "int8".into(),
        block_size: 128,
        num_blocks: 8,
        bytes_per_token: 6264.0,
        capacity_tokens: 1024,
        prefix_caching: true,
    };
    let stats =
        EngineStats { num_running: 2, kv_cache_usage: 0.25, block_size: 128, num_blocks: 8, ..Default::default() };
    let workers = vec![
        WorkerStatus {
            name: "cpu0".into(),
            healthy: true,
            stats: EngineStats { num_running: 2, ..stats },
            decisions: 5,
        },
        WorkerStatus { name: "cpu1".into(), healthy: false, stats: EngineStats::default(), decisions: 1 },
    ];
    let compiles = flint_engine::structured::CompileStats { threads: 1, started: 7, skipped: 2, running: 1, queued: 3 };
    let text = m.render(stats, workers, Some(cache), Some(compiles));
    assert!(text.contains("flint:worker_num_requests_running{model_name=\"demo\",worker=\"cpu0\"} 2"), "{text}");
    assert!(text.contains("flint:worker_num_requests_running{model_name=\"demo\",worker=\"cpu1\"} 0"), "{text}");
    assert!(text.contains("flint:router_decisions_total{model_name=\"demo\",worker=\"cpu0\"} 5"), "{text}");
    assert!(text.contains("flint:worker_healthy{model_name=\"demo\",worker=\"cpu1\"} 0"), "{text}");
    // vLLM's series is the server's total alone: a sum() over it must not count a worker twice.
    for line in text.lines().filter(|l| l.starts_with("vllm:")) {
        assert!(!line.contains("worker="), "{line}");
    }
    assert!(text.contains("vllm:num_requests_running{model_name=\"demo\"} 2\n"), "{text}");
    assert!(text.contains("vllm:kv_cache_usage_perc{model_name=\"demo\"} 0.25"));
    assert!(text.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"demo\",le=\"0.04\"} 1"));
    assert!(text.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"demo\",le=\"+Inf\"} 2"));
    assert!(text.contains("vllm:time_to_first_token_seconds_count{model_name=\"demo\"} 2"));
    assert!(text.contains("vllm:request_success_total{model_name=\"demo\",finished_reason=\"stop\"} 1"));
    assert!(text.contains("flint:request_failure_total{model_name=\"demo\",reason=\"overloaded\"} 1"));
    assert!(text.contains("block_size=\"128\",num_gpu_blocks=\"8\",cache_dtype=\"int8\""), "{text}");
    assert!(text.contains("capacity_tokens=\"1024\""));
    assert!(text.contains("flint:kv_cache_bytes_per_token{model_name=\"demo\"} 6264"));
    assert!(text.contains("flint:grammar_compiles_skipped_total{model_name=\"demo\"} 2"), "{text}");
    assert!(text.contains("flint:grammar_compiles_queued{model_name=\"demo\"} 3"), "{text}");
    let loading = m.render(stats, Vec::new(), None, None);
    assert!(loading.contains("vllm:cache_config_info{model_name=\"demo\",block_size=\"128\""), "{loading}");
}
