//! [`BusBuilder`]: the knobs of [`Config`] set in code, plus the runtime.

use std::marker::PhantomData;
use std::time::Duration;

use tokio::runtime::Handle;

use crate::bus::Bus;
use crate::config::{Batch, Config, DeliveryMode, Overflow, SharePolicy};
use crate::error::Error;

/// Builds a [`Bus`]; every method sets the [`Config`] field of the same name.
///
/// ```
/// use blazesub::{Batch, Bus, DeliveryMode, Overflow};
///
/// let bus = Bus::<u64>::builder()
///     .delivery(DeliveryMode::WorkerPool)
///     .workers(2)
///     .max_concurrent_subscriptions(10)
///     .batch(Batch::Chunked)
///     .overflow(Overflow::CallerRuns)
///     .build()?;
/// assert_eq!(bus.config().workers, 2);
/// # Ok::<(), blazesub::Error>(())
/// ```
#[must_use = "a builder does nothing until .build() is called"]
pub struct BusBuilder<T> {
    config: Config,
    runtime: Option<Handle>,
    value: PhantomData<fn() -> T>,
}

impl<T> Clone for BusBuilder<T> {
    fn clone(&self) -> Self {
        Self {
            config: self.config.clone(),
            runtime: self.runtime.clone(),
            value: PhantomData,
        }
    }
}

impl<T> std::fmt::Debug for BusBuilder<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BusBuilder")
            .field("config", &self.config)
            .field("runtime", &self.runtime.is_some())
            .finish()
    }
}

impl<T: Send + Sync + 'static> Bus<T> {
    /// A builder starting from `Config::default()`.
    pub fn builder() -> BusBuilder<T> {
        BusBuilder::new()
    }
}

impl<T: Send + Sync + 'static> BusBuilder<T> {
    fn new() -> Self {
        Self {
            config: Config::default(),
            runtime: None,
            value: PhantomData,
        }
    }

    /// Replaces every setting with `config`.
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// See [`Config::delivery`].
    pub fn delivery(mut self, delivery: DeliveryMode) -> Self {
        self.config.delivery = delivery;
        self
    }

    /// See [`Config::workers`].
    pub fn workers(mut self, workers: usize) -> Self {
        self.config.workers = workers;
        self
    }

    /// See [`Config::max_concurrent_subscriptions`].
    pub fn max_concurrent_subscriptions(mut self, threshold: usize) -> Self {
        self.config.max_concurrent_subscriptions = threshold;
        self
    }

    /// See [`Config::batch`].
    pub fn batch(mut self, batch: Batch) -> Self {
        self.config.batch = batch;
        self
    }

    /// See [`Config::overflow`].
    pub fn overflow(mut self, overflow: Overflow) -> Self {
        self.config.overflow = overflow;
        self
    }

    /// See [`Config::queue_capacity`].
    pub fn queue_capacity(mut self, capacity: usize) -> Self {
        self.config.queue_capacity = capacity;
        self
    }

    /// See [`Config::max_inflight_tasks`].
    pub fn max_inflight_tasks(mut self, cap: usize) -> Self {
        self.config.max_inflight_tasks = cap;
        self
    }

    /// See [`Config::stream_capacity`].
    pub fn stream_capacity(mut self, capacity: usize) -> Self {
        self.config.stream_capacity = capacity;
        self
    }

    /// See [`Config::route_cache_capacity`].
    pub fn route_cache_capacity(mut self, slots: usize) -> Self {
        self.config.route_cache_capacity = slots;
        self
    }

    /// See [`Config::close_timeout`].
    pub fn close_timeout(mut self, timeout: Duration) -> Self {
        self.config.close_timeout = timeout;
        self
    }

    /// See [`Config::max_retained`].
    pub fn max_retained(mut self, topics: usize) -> Self {
        self.config.max_retained = topics;
        self
    }

    /// See [`Config::retained_expiry`].
    pub fn retained_expiry(mut self, expiry: Duration) -> Self {
        self.config.retained_expiry = Some(expiry);
        self
    }

    /// See [`Config::share_policy`].
    pub fn share_policy(mut self, policy: SharePolicy) -> Self {
        self.config.share_policy = policy;
        self
    }

    /// The tokio runtime to spawn tasks on. Default: the runtime `build` is
    /// called from, if any. The bus never spawns on a caller's context.
    pub fn runtime(mut self, handle: Handle) -> Self {
        self.runtime = Some(handle);
        self
    }

    /// Builds the bus. Errors if a setting is invalid
    /// ([`Error::InvalidConfig`]), if `TaskPerSubscriber` has no runtime
    /// ([`Error::NoRuntime`]), or if worker threads cannot start.
    pub fn build(self) -> Result<Bus<T>, Error> {
        let handle = self.runtime.or_else(|| Handle::try_current().ok());
        Bus::from_parts(self.config, handle)
    }
}
