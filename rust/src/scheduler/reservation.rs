//! *(ours)* Reservations keep a large request from being passed over forever.
//!
//! Without them a request that fits no instance now (batch tokens or KV) waits while a
//! stream of small requests keeps taking the room that frees up. When the first free ready
//! request in load order finds no instance with room, but some instance could hold it once
//! empty, the scheduler reserves for it the instance that would fit it soonest. A reserved
//! instance takes no new free requests (arrivals or migrations) but its reserver's; its
//! residents keep running, finish or leave, so it fits the reserver within a bounded time.
//! At most one reservation exists at a time. It ends when the reserver is dispatched
//! (anywhere), cancelled, or when the instance drains or goes away.
//!
//! "Soonest" is estimated from what the scheduler knows: an instance whose resident room
//! already suffices (or that already holds the request) fits at the end of its next step; otherwise residents must leave first,
//! each at its predicted finish (remaining steps at its highest kept threshold, priced on
//! that instance), and the instance fits once the earliest leavers free enough room. A
//! leaver frees its own extent, and each stored block it reads if it is the last of the
//! block's readers to leave: a system prompt many residents read frees with the last of them.

use std::collections::HashSet;

use super::config::SchedulerConfig;
use super::cost::DegreeCosts;
use super::instance::Instance;
use super::placement::Placement;
use super::request::Request;
use super::request_table::RequestTable;
use super::round::step_prices;
use super::threshold::{remaining_seconds, StepPrices};

/// An instance held for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Reservation {
    /// Handle of the reserving request.
    pub handle: u32,
    /// Slot of the reserved instance.
    pub slot: u32,
}

/// Buffers of [`soonest`].
#[derive(Clone, Debug, Default)]
pub(crate) struct Scratch {
    /// Per instance slot: resident tokens and requests that must leave first (both zero:
    /// it fits once its batch room frees); `None` if it can never hold the request.
    need: Vec<Option<(u64, u64)>>,
    /// Per instance slot: seconds per cache and full step of its residents.
    prices: Vec<(f64, f64)>,
    /// Residents of instances that must shed, by slot and predicted finish.
    leavers: Vec<Leaver>,
    /// Stored blocks a later leaver of the instance being walked reads.
    read_later: HashSet<u64>,
}

/// A resident of an instance that must shed, as [`soonest`] expects it to leave.
#[derive(Clone, Copy, Debug)]
struct Leaver {
    slot: u32,
    /// Predicted finish, in seconds.
    finish: f64,
    /// Its position in the request table.
    pos: u32,
    /// KV tokens its leaving frees.
    freed: u64,
}

/// The instance that would fit request `r` soonest, among those that could hold it empty.
#[allow(clippy::too_many_arguments)]
pub(crate) fn soonest(
    scratch: &mut Scratch,
    requests: &RequestTable,
    instances: &[Instance],
    groups: &[DegreeCosts],
    placement: &Placement,
    config: &SchedulerConfig,
    r: &Request,
    now: f64,
) -> Option<u32> {
    let (seq, n) = (r.seq_tokens(), r.step_tokens());
    scratch.need.clear();
    scratch.prices.clear();
    let mut shedding = false;
    for (slot, inst) in instances.iter().enumerate() {
        let resident = r.home == Some(slot as u32);
        let need = (inst.alive && !inst.draining && inst.could_hold(seq, n)).then(|| {
            if resident {
                return (0, 0);
            }
            let tokens = inst
                .kv_tokens
                .map_or(0, |kv| (inst.kv_used + seq).saturating_sub(kv));
            let reqs = inst.max_requests.map_or(0, |m| {
                (u64::from(inst.residents) + 1).saturating_sub(u64::from(m))
            });
            (tokens, reqs)
        });
        shedding |= need.is_some_and(|(t, q)| t > 0 || q > 0);
        scratch.need.push(need);
        let p = step_prices(
            &groups[inst.group],
            inst,
            config.caching,
            config.block_length,
        );
        scratch.prices.push((p.cache, p.full));
    }
    scratch.leavers.clear();
    if shedding {
        for (pos, q) in requests.reqs().iter().enumerate() {
            let Some(home) = q.home.filter(|_| q.alive) else {
                continue;
            };
            if !scratch.need[home as usize].is_some_and(|(t, c)| t > 0 || c > 0) {
                continue;
            }
            let pos = pos as u32;
            let cap = usize::from(requests.caps()[pos as usize]);
            let (cache, full) = scratch.prices[home as usize];
            let prices = StepPrices { cache, full };
            let finish = now + remaining_seconds(requests.steps_of(pos)[cap], prices);
            scratch.leavers.push(Leaver {
                slot: home,
                finish,
                pos,
                freed: 0,
            });
        }
        scratch
            .leavers
            .sort_unstable_by(|a, b| a.slot.cmp(&b.slot).then(a.finish.total_cmp(&b.finish)));
        for group in scratch.leavers.chunk_by_mut(|a, b| a.slot == b.slot) {
            let inst = &instances[group[0].slot as usize];
            scratch.read_later.clear();
            // Latest first: a block goes with the last of its readers to leave.
            for leaver in group.iter_mut().rev() {
                let q = requests.req(leaver.pos);
                let reads = inst.reads_of(q);
                let last = reads
                    .iter()
                    .filter(|&&k| scratch.read_later.insert(k))
                    .count();
                let still_read = (reads.len() - last) as u64;
                leaver.freed = q.seq_tokens() - still_read * u64::from(q.block_length);
            }
        }
    }
    let mut best: Option<(f64, u32)> = None;
    let mut cursor = 0;
    for (slot, need) in scratch.need.iter().enumerate() {
        let Some((need_tokens, need_reqs)) = *need else {
            continue;
        };
        let slot = slot as u32;
        let inst = &instances[slot as usize];
        let mut at = placement.next_end(slot, inst, &groups[inst.group]);
        if need_tokens > 0 || need_reqs > 0 {
            while cursor < scratch.leavers.len() && scratch.leavers[cursor].slot < slot {
                cursor += 1;
            }
            let (mut freed, mut left) = (0u64, 0u64);
            while cursor < scratch.leavers.len() && scratch.leavers[cursor].slot == slot {
                let leaver = scratch.leavers[cursor];
                cursor += 1;
                if freed < need_tokens || left < need_reqs {
                    freed += leaver.freed;
                    left += 1;
                    at = at.max(leaver.finish);
                }
            }
        }
        if best.is_none_or(|(k, _)| at < k) {
            best = Some((at, slot));
        }
    }
    best.map(|(_, slot)| slot)
}
