//! The overlapped schedule's four events, by name, and the single-edit mutations the tests use
//! to show that each one is needed.

use kda_core::device::Device;
use kda_core::error::Result;
use kda_core::hal::Backend;
use kda_core::resource::{EventHandle, EventId};

/// The four events of the overlapped schedule (`docs/design/schedule.md#events`), in the order they
/// are recorded.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum ScheduleEvent {
    /// Main: the input is ready; the aux stream forks from here.
    HiddenReady,
    /// Aux: the BFG GEMM is queued; main's stage-1 join keeps the QKV GEMM after it.
    BfgProjectionReady,
    /// Main: DynamicQuant is queued; the aux post-process starts after it.
    QuantReady,
    /// Aux: the whole aux tail; main joins it before anything consumes beta, g1, g2.
    BfgReady,
}

impl ScheduleEvent {
    pub const ALL: [ScheduleEvent; 4] = [
        ScheduleEvent::HiddenReady,
        ScheduleEvent::BfgProjectionReady,
        ScheduleEvent::QuantReady,
        ScheduleEvent::BfgReady,
    ];

    /// The seeds' name (`docs/design/README.md#the-seeds`).
    pub fn name(self) -> &'static str {
        match self {
            ScheduleEvent::HiddenReady => "hidden_ready",
            ScheduleEvent::BfgProjectionReady => "bfg_projection_ready",
            ScheduleEvent::QuantReady => "quant_ready",
            ScheduleEvent::BfgReady => "bfg_ready",
        }
    }
}

/// The events one projection uses, reused by every call.
#[derive(Clone, Debug)]
pub struct ScheduleEvents<B: Backend> {
    pub hidden_ready: B::Event,
    pub bfg_projection_ready: B::Event,
    pub quant_ready: B::Event,
    pub bfg_ready: B::Event,
}

impl<B: Backend> ScheduleEvents<B> {
    pub fn new(device: &Device<B>) -> Result<Self> {
        Ok(Self {
            hidden_ready: device.new_event()?,
            bfg_projection_ready: device.new_event()?,
            quant_ready: device.new_event()?,
            bfg_ready: device.new_event()?,
        })
    }

    pub fn get(&self, event: ScheduleEvent) -> &B::Event {
        match event {
            ScheduleEvent::HiddenReady => &self.hidden_ready,
            ScheduleEvent::BfgProjectionReady => &self.bfg_projection_ready,
            ScheduleEvent::QuantReady => &self.quant_ready,
            ScheduleEvent::BfgReady => &self.bfg_ready,
        }
    }

    /// Which of the four an event id is (to read a recorded log).
    pub fn which(&self, id: EventId) -> Option<ScheduleEvent> {
        ScheduleEvent::ALL.into_iter().find(|&e| self.get(e).id() == id)
    }
}

/// One edit to the overlapped order, for tests that show each event is needed (the sanitizer or
/// the capture must then object). Not for production use.
#[doc(hidden)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum Mutation {
    /// The order as `docs/design/schedule.md#overlapped` gives it.
    #[default]
    None,
    /// Leave out the record of this event.
    DropRecord(ScheduleEvent),
    /// Leave out the wait on this event.
    DropWait(ScheduleEvent),
    /// Record `bfg_ready` before the post-process instead of after it.
    RecordBfgReadyBeforePostprocess,
}

impl Mutation {
    pub(crate) fn keeps_record(self, event: ScheduleEvent) -> bool {
        self != Mutation::DropRecord(event)
    }

    pub(crate) fn keeps_wait(self, event: ScheduleEvent) -> bool {
        self != Mutation::DropWait(event)
    }
}
