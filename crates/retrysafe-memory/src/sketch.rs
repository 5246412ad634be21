//! A bounded heavy-hitters sketch (Space-Saving) of the bytes each scope holds.

/// The scopes holding the most bytes, approximately, in a fixed number of counters.
///
/// Space-Saving: a scope already counted adds to its counter; a new scope takes the
/// smallest counter over and starts from its value (an overestimate, never an
/// underestimate, for a scope that holds more than `total / CAPACITY`). Bytes freed by
/// a counted scope are taken back from its counter, so the counts follow what scopes
/// hold now rather than what they ever wrote.
#[derive(Debug, Default)]
pub(crate) struct Sketch {
    counters: Vec<Counter>,
}

#[derive(Debug, Clone, Copy)]
struct Counter {
    scope: u64,
    bytes: u64,
}

impl Sketch {
    /// The number of counters: enough to single out every scope that holds more than a
    /// 32nd of the budget.
    pub(crate) const CAPACITY: usize = 32;

    /// Counts `bytes` more for `scope`.
    pub(crate) fn add(&mut self, scope: u64, bytes: u64) {
        if let Some(c) = self.counters.iter_mut().find(|c| c.scope == scope) {
            c.bytes = c.bytes.saturating_add(bytes);
            return;
        }
        if self.counters.len() < Self::CAPACITY {
            self.counters.push(Counter { scope, bytes });
            return;
        }
        if let Some(min) = self.counters.iter_mut().min_by_key(|c| c.bytes) {
            *min = Counter {
                scope,
                bytes: min.bytes.saturating_add(bytes),
            };
        }
    }

    /// Counts `bytes` fewer for `scope`, if it is counted.
    pub(crate) fn sub(&mut self, scope: u64, bytes: u64) {
        if let Some(c) = self.counters.iter_mut().find(|c| c.scope == scope) {
            c.bytes = c.bytes.saturating_sub(bytes);
        }
    }

    /// Forgets `scope` (it holds nothing any more).
    pub(crate) fn forget(&mut self, scope: u64) {
        self.counters.retain(|c| c.scope != scope);
    }

    /// The scope counted heaviest and its count.
    pub(crate) fn heaviest(&self) -> Option<(u64, u64)> {
        self.counters
            .iter()
            .filter(|c| c.bytes > 0)
            .max_by_key(|c| c.bytes)
            .map(|c| (c.scope, c.bytes))
    }

    /// The number of scopes counted as holding something.
    pub(crate) fn active(&self) -> u64 {
        self.counters.iter().filter(|c| c.bytes > 0).count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heavy_scope_stands_out_among_many_light_ones() {
        let mut s = Sketch::default();
        for i in 0..10_000u64 {
            s.add(1_000 + i, 10);
            if i % 4 == 0 {
                s.add(7, 100);
            }
        }
        assert_eq!(s.heaviest().map(|(scope, _)| scope), Some(7));
        s.sub(7, u64::MAX);
        assert_ne!(s.heaviest().map(|(scope, _)| scope), Some(7));
        s.forget(7);
        assert!(s.active() <= Sketch::CAPACITY as u64);
    }
}
