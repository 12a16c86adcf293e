//! `Config`: its defaults, its serde form, its validation, the builder that
//! sets the same knobs, and the runtime a `TaskPerSubscriber` bus needs.

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use blazesub::{Batch, Bus, Config, DeliveryMode, Error, Message, Overflow};

fn parse(json: &str) -> Result<Config, serde_json::Error> {
    serde_json::from_str(json)
}

fn parse_ok(json: &str) -> Config {
    parse(json).unwrap_or_else(|e| panic!("{json} should parse: {e}"))
}

fn available_parallelism() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// `Config::default()` with one field changed (`Config` is `#[non_exhaustive]`,
/// so other crates cannot use struct update syntax).
fn with(change: impl FnOnce(&mut Config)) -> Config {
    let mut config = Config::default();
    change(&mut config);
    config
}

// ---------------------------------------------------------------------------
// Defaults
// ---------------------------------------------------------------------------

#[test]
fn defaults_are_the_documented_ones() {
    let c = Config::default();
    assert_eq!(c.delivery, DeliveryMode::WorkerPool);
    assert_eq!(c.workers, available_parallelism());
    assert!(c.workers >= 1);
    assert_eq!(c.max_concurrent_subscriptions, 10);
    assert_eq!(c.batch, Batch::Chunked);
    assert_eq!(c.overflow, Overflow::Wait);
    assert_eq!(c.queue_capacity, 4096);
    assert_eq!(c.max_inflight_tasks, 1024);
    assert_eq!(c.stream_capacity, 1024);
    assert_eq!(c.route_cache_capacity, 4096);
    assert_eq!(c.close_timeout, Duration::from_secs(30));
}

#[test]
fn enum_defaults_match_config_defaults() {
    assert_eq!(DeliveryMode::default(), DeliveryMode::WorkerPool);
    assert_eq!(Batch::default(), Batch::Chunked);
    assert_eq!(Overflow::default(), Overflow::Wait);
}

#[test]
fn defaults_validate_and_build() {
    Config::default().validate().unwrap();
    let bus = Bus::<u32>::new(Config::default()).unwrap();
    assert_eq!(bus.config(), &Config::default());
    let bus = Bus::<u32>::builder().build().unwrap();
    assert_eq!(bus.config(), &Config::default());
}

#[test]
fn default_bus_delivers_with_the_default_stream_capacity() {
    let bus = Bus::<u32>::builder().build().unwrap();
    let rx = bus.subscribe_stream("a").unwrap();
    assert_eq!(rx.capacity(), 1024);
}

// ---------------------------------------------------------------------------
// serde
// ---------------------------------------------------------------------------

#[test]
fn empty_object_is_the_default() {
    assert_eq!(parse_ok("{}"), Config::default());
}

#[test]
fn missing_fields_take_their_defaults() {
    let c = parse_ok(r#"{ "workers": 3, "overflow": "drop" }"#);
    assert_eq!(c.workers, 3);
    assert_eq!(c.overflow, Overflow::Drop);
    let expected = Config {
        workers: 3,
        overflow: Overflow::Drop,
        ..Config::default()
    };
    assert_eq!(c, expected);
}

#[test]
fn every_field_can_be_set() {
    let c = parse_ok(
        r#"{
            "delivery": "inline",
            "workers": 7,
            "max_concurrent_subscriptions": 99,
            "batch": "single",
            "overflow": "error",
            "queue_capacity": 17,
            "max_inflight_tasks": 5,
            "stream_capacity": 3,
            "route_cache_capacity": 0,
            "close_timeout": "250ms"
        }"#,
    );
    assert_eq!(c.delivery, DeliveryMode::Inline);
    assert_eq!(c.workers, 7);
    assert_eq!(c.max_concurrent_subscriptions, 99);
    assert_eq!(c.batch, Batch::Single);
    assert_eq!(c.overflow, Overflow::Error);
    assert_eq!(c.queue_capacity, 17);
    assert_eq!(c.max_inflight_tasks, 5);
    assert_eq!(c.stream_capacity, 3);
    assert_eq!(c.route_cache_capacity, 0);
    assert_eq!(c.close_timeout, Duration::from_millis(250));
    c.validate().unwrap();
    // A bus built from it keeps it.
    let bus = Bus::<u32>::new(c.clone()).unwrap();
    assert_eq!(bus.config(), &c);
}

#[test]
fn delivery_mode_names_are_snake_case() {
    for (name, mode) in [
        ("task_per_subscriber", DeliveryMode::TaskPerSubscriber),
        ("worker_pool", DeliveryMode::WorkerPool),
        ("inline", DeliveryMode::Inline),
    ] {
        let c = parse_ok(&format!(r#"{{ "delivery": "{name}" }}"#));
        assert_eq!(c.delivery, mode, "{name}");
    }
}

#[test]
fn batch_names_are_snake_case() {
    for (name, batch) in [("single", Batch::Single), ("chunked", Batch::Chunked)] {
        let c = parse_ok(&format!(r#"{{ "batch": "{name}" }}"#));
        assert_eq!(c.batch, batch, "{name}");
    }
}

#[test]
fn overflow_names_are_snake_case() {
    for (name, overflow) in [
        ("caller_runs", Overflow::CallerRuns),
        ("drop", Overflow::Drop),
        ("error", Overflow::Error),
    ] {
        let c = parse_ok(&format!(r#"{{ "overflow": "{name}" }}"#));
        assert_eq!(c.overflow, overflow, "{name}");
    }
}

#[test]
fn enum_names_in_other_cases_are_rejected() {
    for json in [
        r#"{ "delivery": "WorkerPool" }"#,
        r#"{ "delivery": "workerPool" }"#,
        r#"{ "delivery": "worker-pool" }"#,
        r#"{ "delivery": "TaskPerSubscriber" }"#,
        r#"{ "delivery": "Inline" }"#,
        r#"{ "delivery": "pool" }"#,
        r#"{ "batch": "Chunked" }"#,
        r#"{ "batch": "SINGLE" }"#,
        r#"{ "overflow": "CallerRuns" }"#,
        r#"{ "overflow": "caller-runs" }"#,
        r#"{ "overflow": "Drop" }"#,
        r#"{ "delivery": "" }"#,
        r#"{ "delivery": 1 }"#,
    ] {
        assert!(parse(json).is_err(), "{json} should be rejected");
    }
}

#[test]
fn enums_serialize_to_their_snake_case_names() {
    assert_eq!(
        serde_json::to_string(&DeliveryMode::TaskPerSubscriber).unwrap(),
        r#""task_per_subscriber""#
    );
    assert_eq!(
        serde_json::to_string(&Overflow::CallerRuns).unwrap(),
        r#""caller_runs""#
    );
    assert_eq!(
        serde_json::to_string(&Batch::Chunked).unwrap(),
        r#""chunked""#
    );
}

#[test]
fn close_timeout_accepts_human_durations_and_seconds() {
    for (json, expected) in [
        (r#""250ms""#, Duration::from_millis(250)),
        (r#""30s""#, Duration::from_secs(30)),
        (r#""2m""#, Duration::from_secs(120)),
        (r#""1h""#, Duration::from_secs(3600)),
        (r#""1.5s""#, Duration::from_millis(1500)),
        (r#""0s""#, Duration::ZERO),
        ("5", Duration::from_secs(5)),
        ("0", Duration::ZERO),
        ("0.25", Duration::from_millis(250)),
    ] {
        let c = parse_ok(&format!(r#"{{ "close_timeout": {json} }}"#));
        assert_eq!(c.close_timeout, expected, "close_timeout: {json}");
    }
}

#[test]
fn close_timeout_rejects_nonsense_without_panicking() {
    for json in [
        r#""10""#,
        r#""""#,
        r#""s""#,
        r#""ms""#,
        r#""10 weeks""#,
        r#""10d""#,
        r#""-1s""#,
        r#""1e3s""#,
        r#""99999999999999999999999h""#,
        "-1",
        "-0.5",
        "1e300",
        "true",
        "null",
        "[]",
    ] {
        let result = parse(&format!(r#"{{ "close_timeout": {json} }}"#));
        assert!(
            result.is_err(),
            "close_timeout {json} should be rejected, got {result:?}"
        );
    }
}

#[test]
fn close_timeout_error_message_shows_the_expected_forms() {
    let err = parse(r#"{ "close_timeout": "ten seconds" }"#).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("ten seconds"), "{text}");
    assert!(text.contains("30s"), "{text}");
}

#[test]
fn unknown_fields_are_rejected() {
    for json in [
        r#"{ "worker": 4 }"#,
        r#"{ "workers": 4, "threads": 2 }"#,
        r#"{ "Workers": 4 }"#,
        r#"{ "closeTimeout": "1s" }"#,
    ] {
        let err = parse(json).expect_err(json);
        assert!(err.to_string().contains("unknown field"), "{json}: {err}");
    }
    let err = parse(r#"{ "worker": 4 }"#).unwrap_err();
    assert!(err.to_string().contains("`worker`"), "{err}");
}

#[test]
fn wrongly_typed_numbers_are_rejected() {
    for json in [
        r#"{ "workers": -1 }"#,
        r#"{ "workers": "4" }"#,
        r#"{ "workers": 1.5 }"#,
        r#"{ "queue_capacity": null }"#,
        r#"{ "stream_capacity": [] }"#,
    ] {
        assert!(parse(json).is_err(), "{json} should be rejected");
    }
}

#[test]
fn config_round_trips_through_json() {
    let c = Config {
        delivery: DeliveryMode::TaskPerSubscriber,
        workers: 3,
        batch: Batch::Single,
        overflow: Overflow::Drop,
        close_timeout: Duration::from_millis(1500),
        ..Config::default()
    };
    let json = serde_json::to_string(&c).unwrap();
    assert!(json.contains(r#""task_per_subscriber""#), "{json}");
    assert_eq!(parse_ok(&json), c);
    assert_eq!(
        parse_ok(&serde_json::to_string(&Config::default()).unwrap()),
        Config::default()
    );
}

// ---------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------

/// A field's name and a way to set it to zero.
type Zeroer = (&'static str, fn(&mut Config));

/// The fields that must be at least 1.
const AT_LEAST_ONE: [Zeroer; 4] = [
    ("workers", |c| c.workers = 0),
    ("queue_capacity", |c| c.queue_capacity = 0),
    ("stream_capacity", |c| c.stream_capacity = 0),
    ("max_inflight_tasks", |c| c.max_inflight_tasks = 0),
];

#[track_caller]
fn assert_invalid(result: Result<impl Debug, Error>, field: &str) {
    match result {
        Err(Error::InvalidConfig {
            field: f,
            ref value,
            ..
        }) => {
            assert_eq!(f, field);
            assert_eq!(value, "0");
            let text = result.as_ref().unwrap_err().to_string();
            assert!(text.contains(field), "{text}");
        }
        other => panic!("expected InvalidConfig for {field}, got {other:?}"),
    }
}

#[test]
fn zero_values_fail_validate_naming_the_field() {
    for (field, zero) in AT_LEAST_ONE {
        assert_invalid(with(zero).validate(), field);
    }
}

#[test]
fn zero_values_fail_bus_new_naming_the_field() {
    for (field, zero) in AT_LEAST_ONE {
        assert_invalid(Bus::<u32>::new(with(zero)), field);
        // Whatever the delivery mode.
        let mut config = with(zero);
        config.delivery = DeliveryMode::Inline;
        assert_invalid(Bus::<u32>::new(config), field);
    }
}

#[test]
fn zero_values_fail_builder_naming_the_field() {
    assert_invalid(Bus::<u32>::builder().workers(0).build(), "workers");
    assert_invalid(
        Bus::<u32>::builder().queue_capacity(0).build(),
        "queue_capacity",
    );
    assert_invalid(
        Bus::<u32>::builder().stream_capacity(0).build(),
        "stream_capacity",
    );
    assert_invalid(
        Bus::<u32>::builder().max_inflight_tasks(0).build(),
        "max_inflight_tasks",
    );
    for (field, zero) in AT_LEAST_ONE {
        assert_invalid(Bus::<u32>::builder().config(with(zero)).build(), field);
    }
}

#[test]
fn zero_values_from_json_parse_but_do_not_build() {
    for field in [
        "workers",
        "queue_capacity",
        "stream_capacity",
        "max_inflight_tasks",
    ] {
        let config = parse_ok(&format!(r#"{{ "{field}": 0 }}"#));
        assert_invalid(config.validate(), field);
        assert_invalid(Bus::<u32>::new(config), field);
    }
}

#[test]
fn threshold_zero_and_route_cache_zero_are_valid() {
    let config = with(|c| {
        c.max_concurrent_subscriptions = 0;
        c.route_cache_capacity = 0;
    });
    config.validate().unwrap();
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .max_concurrent_subscriptions(0)
        .route_cache_capacity(0)
        .build()
        .unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = Arc::clone(&hits);
    let _sub = bus
        .subscribe("a/+", move |_: &Message<u32>| {
            h.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    assert_eq!(bus.publish("a/b", 1).unwrap(), 1);
    assert_eq!(bus.publish("a/b", 2).unwrap(), 1);
    assert_eq!(hits.load(Ordering::SeqCst), 2);
}

#[test]
fn huge_route_cache_is_rejected() {
    let err = with(|c| c.route_cache_capacity = usize::MAX)
        .validate()
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                field: "route_cache_capacity",
                ..
            }
        ),
        "{err:?}"
    );
    let result = Bus::<u32>::builder()
        .route_cache_capacity(usize::MAX)
        .build();
    assert!(matches!(
        result,
        Err(Error::InvalidConfig {
            field: "route_cache_capacity",
            ..
        })
    ));
    // The documented largest size is accepted.
    with(|c| c.route_cache_capacity = 1 << 24)
        .validate()
        .unwrap();
}

#[test]
fn stream_capacity_zero_per_subscription_is_an_error_not_a_panic() {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    assert!(matches!(
        bus.subscribe_stream_with_capacity("a", 0),
        Err(Error::InvalidArgument {
            name: "capacity",
            ..
        })
    ));
    assert_eq!(bus.subscriptions_count(), 0);
}

#[test]
fn invalid_config_display_names_field_value_and_reason() {
    let err = with(|c| c.workers = 0).validate().unwrap_err();
    let text = err.to_string();
    assert!(text.contains("`workers`"), "{text}");
    assert!(text.contains('0'), "{text}");
    assert!(text.contains("at least 1"), "{text}");
}

// ---------------------------------------------------------------------------
// The runtime
// ---------------------------------------------------------------------------

#[test]
fn task_per_subscriber_outside_a_runtime_is_an_error() {
    assert!(tokio::runtime::Handle::try_current().is_err());
    let result = Bus::<u32>::builder()
        .delivery(DeliveryMode::TaskPerSubscriber)
        .build();
    match result {
        Err(Error::NoRuntime { what }) => assert!(!what.is_empty()),
        other => panic!("expected NoRuntime, got {other:?}"),
    }
    let config = with(|c| c.delivery = DeliveryMode::TaskPerSubscriber);
    let err = Bus::<u32>::new(config).unwrap_err();
    assert!(matches!(err, Error::NoRuntime { .. }), "{err:?}");
    assert!(err.to_string().contains("tokio runtime"), "{err}");
}

#[test]
fn other_modes_build_outside_a_runtime() {
    for mode in [DeliveryMode::WorkerPool, DeliveryMode::Inline] {
        let bus = Bus::<u32>::builder().delivery(mode).build().unwrap();
        assert_eq!(bus.config().delivery, mode);
    }
}

#[tokio::test]
async fn task_per_subscriber_inside_a_runtime_builds_and_delivers() {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::TaskPerSubscriber)
        .build()
        .unwrap();
    assert_eq!(bus.config().delivery, DeliveryMode::TaskPerSubscriber);
    let hits = Arc::new(AtomicUsize::new(0));
    let h = Arc::clone(&hits);
    let _sub = bus
        .subscribe("a/#", move |_: &Message<u32>| {
            h.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    for i in 0..10 {
        assert_eq!(bus.publish("a/b", i).unwrap(), 1);
    }
    bus.close().await.unwrap();
    assert_eq!(hits.load(Ordering::SeqCst), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_per_subscriber_inside_a_multi_thread_runtime_builds() {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::TaskPerSubscriber)
        .build()
        .unwrap();
    let mut rx = bus.subscribe_stream("x").unwrap();
    bus.publish("x", 5).unwrap();
    assert_eq!(*rx.recv().await.unwrap().data(), 5);
    bus.close().await.unwrap();
}

#[test]
fn task_per_subscriber_with_a_given_runtime_builds_outside_it() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    assert!(tokio::runtime::Handle::try_current().is_err());
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::TaskPerSubscriber)
        .runtime(runtime.handle().clone())
        .build()
        .unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = Arc::clone(&hits);
    let _sub = bus
        .subscribe("t", move |_: &Message<u32>| {
            h.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    bus.publish("t", 1).unwrap();
    runtime.block_on(bus.close()).unwrap();
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

#[test]
fn subscribe_async_without_a_runtime_is_an_error() {
    for mode in [DeliveryMode::WorkerPool, DeliveryMode::Inline] {
        let bus = Bus::<u32>::builder().delivery(mode).build().unwrap();
        let result = bus.subscribe_async("a/#", |_m: Arc<Message<u32>>| async {});
        match result {
            Err(Error::NoRuntime { what }) => assert!(!what.is_empty()),
            other => panic!("{mode:?}: expected NoRuntime, got {other:?}"),
        }
        assert_eq!(bus.subscriptions_count(), 0);
    }
}

#[test]
fn subscribe_async_on_a_runtimeless_bus_fails_even_inside_a_runtime() {
    // The bus keeps the runtime it was built in (none here); it never spawns
    // on the caller's context.
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let _guard = runtime.enter();
    let result = bus.subscribe_async("a", |_m: Arc<Message<u32>>| async {});
    assert!(matches!(result, Err(Error::NoRuntime { .. })), "{result:?}");
}

#[tokio::test]
async fn subscribe_async_inside_a_runtime_works() {
    let bus = Bus::<u32>::builder().build().unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let _sub = bus
        .subscribe_async("a/#", move |m: Arc<Message<u32>>| {
            let tx = tx.clone();
            async move {
                tokio::task::yield_now().await;
                tx.send(*m.data()).unwrap();
            }
        })
        .unwrap();
    bus.publish("a/b", 42).unwrap();
    assert_eq!(rx.recv().await, Some(42));
    bus.close().await.unwrap();
}

// ---------------------------------------------------------------------------
// The builder sets the same fields
// ---------------------------------------------------------------------------

#[tokio::test]
async fn builder_methods_set_config_fields() {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::TaskPerSubscriber)
        .workers(3)
        .max_concurrent_subscriptions(42)
        .batch(Batch::Single)
        .overflow(Overflow::Error)
        .queue_capacity(11)
        .max_inflight_tasks(13)
        .stream_capacity(17)
        .route_cache_capacity(19)
        .close_timeout(Duration::from_millis(1234))
        .build()
        .unwrap();
    let c = bus.config();
    assert_eq!(c.delivery, DeliveryMode::TaskPerSubscriber);
    assert_eq!(c.workers, 3);
    assert_eq!(c.max_concurrent_subscriptions, 42);
    assert_eq!(c.batch, Batch::Single);
    assert_eq!(c.overflow, Overflow::Error);
    assert_eq!(c.queue_capacity, 11);
    assert_eq!(c.max_inflight_tasks, 13);
    assert_eq!(c.stream_capacity, 17);
    assert_eq!(c.route_cache_capacity, 19);
    assert_eq!(c.close_timeout, Duration::from_millis(1234));
    // The stream capacity is used, not only stored.
    let rx = bus.subscribe_stream("s").unwrap();
    assert_eq!(rx.capacity(), 17);
    bus.close().await.unwrap();
}

#[test]
fn builder_config_replaces_every_setting_and_later_calls_override() {
    let base = parse_ok(
        r#"{ "delivery": "inline", "workers": 2, "batch": "single", "close_timeout": "2m" }"#,
    );
    let bus = Bus::<u32>::builder()
        .workers(9)
        .config(base.clone())
        .build()
        .unwrap();
    assert_eq!(bus.config(), &base);
    let bus = Bus::<u32>::builder()
        .config(base.clone())
        .overflow(Overflow::Drop)
        .build()
        .unwrap();
    let mut expected = base;
    expected.overflow = Overflow::Drop;
    assert_eq!(bus.config(), &expected);
}

#[test]
fn bus_new_and_builder_agree() {
    let config = parse_ok(r#"{ "workers": 2, "overflow": "drop", "stream_capacity": 8 }"#);
    let a = Bus::<u32>::new(config.clone()).unwrap();
    let b = Bus::<u32>::builder()
        .workers(2)
        .overflow(Overflow::Drop)
        .stream_capacity(8)
        .build()
        .unwrap();
    assert_eq!(a.config(), b.config());
    assert_eq!(a.config(), &config);
}

// ---------------------------------------------------------------------------
// close_timeout is used
// ---------------------------------------------------------------------------

#[tokio::test]
async fn close_timeout_limits_close() {
    let bus = Bus::<u32>::builder()
        .workers(1)
        .close_timeout(Duration::from_millis(50))
        .build()
        .unwrap();
    let _sub = bus
        .subscribe("slow", |_: &Message<u32>| {
            std::thread::sleep(Duration::from_millis(400));
        })
        .unwrap();
    bus.publish("slow", 1).unwrap();
    let started = std::time::Instant::now();
    let result = bus.close().await;
    let elapsed = started.elapsed();
    match result {
        Err(error @ Error::CloseTimeout { waited, inflight }) => {
            assert!(waited >= Duration::from_millis(50), "{waited:?}");
            assert_eq!(inflight, 1);
            // The message says what happens to them and where to look.
            let message = error.to_string();
            assert!(
                message.contains("1 deliveries still in flight"),
                "{message}"
            );
            assert!(message.contains("still finish"), "{message}");
            assert!(message.contains("Stats::inflight"), "{message}");
        }
        other => panic!("expected CloseTimeout, got {other:?}"),
    }
    assert!(
        elapsed < Duration::from_millis(350),
        "close waited {elapsed:?}"
    );
}

#[tokio::test]
async fn huge_close_timeout_does_not_overflow() {
    let config = parse_ok(r#"{ "workers": 1, "close_timeout": 18446744073709551615 }"#);
    assert_eq!(config.close_timeout, Duration::from_secs(u64::MAX));
    let bus = Bus::<u32>::new(config).unwrap();
    let _sub = bus
        .subscribe("slow", |_: &Message<u32>| {
            std::thread::sleep(Duration::from_millis(30));
        })
        .unwrap();
    bus.publish("slow", 1).unwrap();
    bus.close().await.unwrap();
}

// ---------------------------------------------------------------------------
// Trait bounds of the enums and of Config
// ---------------------------------------------------------------------------

fn assert_value_enum<T: Copy + Clone + Eq + PartialEq + Debug + Hash + Default + Send + Sync>() {}

#[test]
fn enums_are_copy_eq_debug() {
    assert_value_enum::<DeliveryMode>();
    assert_value_enum::<Batch>();
    assert_value_enum::<Overflow>();

    let mode = DeliveryMode::Inline;
    let copy = mode; // Copy: `mode` is still usable.
    assert_eq!(mode, copy);
    assert_ne!(DeliveryMode::Inline, DeliveryMode::WorkerPool);
    assert_ne!(DeliveryMode::WorkerPool, DeliveryMode::TaskPerSubscriber);
    assert_ne!(Batch::Single, Batch::Chunked);
    assert_ne!(Overflow::Drop, Overflow::Error);
    assert_ne!(Overflow::CallerRuns, Overflow::Drop);

    assert_eq!(
        format!("{:?}", DeliveryMode::TaskPerSubscriber),
        "TaskPerSubscriber"
    );
    assert_eq!(format!("{:?}", DeliveryMode::WorkerPool), "WorkerPool");
    assert_eq!(format!("{:?}", DeliveryMode::Inline), "Inline");
    assert_eq!(format!("{:?}", Batch::Single), "Single");
    assert_eq!(format!("{:?}", Batch::Chunked), "Chunked");
    assert_eq!(format!("{:?}", Overflow::CallerRuns), "CallerRuns");
    assert_eq!(format!("{:?}", Overflow::Drop), "Drop");
    assert_eq!(format!("{:?}", Overflow::Error), "Error");
}

#[test]
fn config_is_clone_eq_debug_send_sync() {
    fn assert_traits<T: Clone + PartialEq + Debug + Default + Send + Sync + 'static>() {}
    assert_traits::<Config>();
    let a = Config::default();
    let mut b = a.clone();
    assert_eq!(a, b);
    b.workers += 1;
    assert_ne!(a, b);
    let text = format!("{a:?}");
    assert!(text.contains("close_timeout"), "{text}");
}

/// A builder can be kept as a template: cloned, and printed with its
/// configuration.
#[test]
fn a_bus_builder_clones_and_prints() {
    let template = blazesub::Bus::<u32>::builder()
        .workers(3)
        .stream_capacity(64);
    let printed = format!("{template:?}");
    assert!(printed.contains("workers: 3"), "{printed}");
    let one = template.clone().build().unwrap();
    let two = template.build().unwrap();
    assert_eq!(one.config(), two.config());
    assert_eq!(one.config().stream_capacity, 64);
}
