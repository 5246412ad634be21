//! The order in which completed records are shrunk: least recently used first, over all
//! records and within each scope. Two intrusive doubly-linked lists thread one slab of
//! nodes, so a record is added, moved to the back or taken out of both orders in a few
//! writes, with no allocation (once the slab has grown) and no search.

use std::collections::HashMap;

use retrysafe_core::__private::DigestHash;
use retrysafe_core::idempotency::RecordId;

/// The place of a record in the [`Order`].
pub(crate) type Slot = usize;

/// No slot: the end of a list, or a record that is in no list.
pub(crate) const NIL: Slot = usize::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    id: RecordId,
    scope: u64,
    /// Over all records.
    all: Links,
    /// Within its scope.
    of_scope: Links,
}

#[derive(Debug, Clone, Copy)]
struct Links {
    prev: Slot,
    next: Slot,
}

/// The first and last node of a list.
#[derive(Debug, Clone, Copy)]
struct Ends {
    head: Slot,
    tail: Slot,
}

impl Ends {
    const EMPTY: Ends = Ends {
        head: NIL,
        tail: NIL,
    };
}

/// Which list of a node.
#[derive(Clone, Copy)]
enum List {
    All,
    OfScope,
}

impl List {
    fn links(self, node: &mut Node) -> &mut Links {
        match self {
            List::All => &mut node.all,
            List::OfScope => &mut node.of_scope,
        }
    }
}

/// The completed records, least recently used first, overall and per scope.
#[derive(Debug)]
pub(crate) struct Order {
    /// Nodes; a free node's `all.next` links the free list.
    nodes: Vec<Node>,
    free: Slot,
    len: usize,
    all: Ends,
    /// The scopes that hold a record (a scope whose last record goes is removed).
    scopes: HashMap<u64, Ends, DigestHash>,
}

impl Default for Order {
    fn default() -> Self {
        Order {
            nodes: Vec::new(),
            free: NIL,
            len: 0,
            all: Ends::EMPTY,
            scopes: HashMap::default(),
        }
    }
}

impl Order {
    /// The number of records listed.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Lists `id` of `scope` as the most recently used; its slot.
    pub(crate) fn push(&mut self, id: RecordId, scope: u64) -> Slot {
        let node = Node {
            id,
            scope,
            all: Links {
                prev: NIL,
                next: NIL,
            },
            of_scope: Links {
                prev: NIL,
                next: NIL,
            },
        };
        let slot = match self.nodes.get_mut(self.free) {
            Some(free) => {
                let slot = self.free;
                self.free = free.all.next;
                *free = node;
                slot
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        };
        self.len += 1;
        self.link(slot);
        slot
    }

    /// Takes the record at `slot` out of the order.
    pub(crate) fn remove(&mut self, slot: Slot) {
        if slot >= self.nodes.len() {
            return;
        }
        self.unlink(slot, true);
        self.len -= 1;
        if let Some(node) = self.nodes.get_mut(slot) {
            node.all.next = self.free;
            self.free = slot;
        }
    }

    /// Moves the record at `slot` to the back: the most recently used, overall and in
    /// its scope.
    pub(crate) fn touch(&mut self, slot: Slot) {
        if slot >= self.nodes.len() {
            return;
        }
        // Its scope keeps its entry: the record goes right back in.
        self.unlink(slot, false);
        self.link(slot);
    }

    /// The records, least recently used first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = RecordId> + '_ {
        self.walk(self.all.head, List::All)
    }

    /// The records of `scope`, least recently used first.
    pub(crate) fn of_scope(&self, scope: u64) -> impl Iterator<Item = RecordId> + '_ {
        let head = self.scopes.get(&scope).map_or(NIL, |ends| ends.head);
        self.walk(head, List::OfScope)
    }

    fn walk(&self, head: Slot, list: List) -> impl Iterator<Item = RecordId> + '_ {
        let mut at = head;
        std::iter::from_fn(move || {
            let mut node = *self.nodes.get(at)?;
            at = list.links(&mut node).next;
            Some(node.id)
        })
    }

    /// Appends the node at `slot` to both of its lists.
    fn link(&mut self, slot: Slot) {
        let Some(scope) = self.nodes.get(slot).map(|n| n.scope) else {
            return;
        };
        append(&mut self.nodes, &mut self.all, slot, List::All);
        let ends = self.scopes.entry(scope).or_insert(Ends::EMPTY);
        append(&mut self.nodes, ends, slot, List::OfScope);
    }

    /// Takes the node at `slot` out of both of its lists; with `drop_empty`, forgets
    /// its scope if that held nothing else.
    fn unlink(&mut self, slot: Slot, drop_empty: bool) {
        let Some(scope) = self.nodes.get(slot).map(|n| n.scope) else {
            return;
        };
        detach(&mut self.nodes, &mut self.all, slot, List::All);
        if let Some(ends) = self.scopes.get_mut(&scope) {
            detach(&mut self.nodes, ends, slot, List::OfScope);
            if drop_empty && ends.head == NIL {
                self.scopes.remove(&scope);
            }
        }
    }
}

/// Appends the node at `slot` to `list`, whose ends are `ends`.
fn append(nodes: &mut [Node], ends: &mut Ends, slot: Slot, list: List) {
    let tail = ends.tail;
    if let Some(node) = nodes.get_mut(slot) {
        *list.links(node) = Links {
            prev: tail,
            next: NIL,
        };
    }
    match nodes.get_mut(tail) {
        Some(last) => list.links(last).next = slot,
        None => ends.head = slot,
    }
    ends.tail = slot;
}

/// Takes the node at `slot` out of `list`, whose ends are `ends`.
fn detach(nodes: &mut [Node], ends: &mut Ends, slot: Slot, list: List) {
    let Some(node) = nodes.get_mut(slot) else {
        return;
    };
    let Links { prev, next } = *list.links(node);
    match nodes.get_mut(prev) {
        Some(p) => list.links(p).next = next,
        None => ends.head = next,
    }
    match nodes.get_mut(next) {
        Some(n) => list.links(n).prev = prev,
        None => ends.tail = prev,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> RecordId {
        RecordId::from_bytes([n; 32])
    }

    fn ids(it: impl Iterator<Item = RecordId>) -> Vec<u8> {
        it.map(|id| id.as_bytes()[0]).collect()
    }

    #[test]
    fn least_recently_used_first_overall_and_per_scope() {
        let mut o = Order::default();
        let a = o.push(id(1), 7);
        let b = o.push(id(2), 8);
        let c = o.push(id(3), 7);
        let d = o.push(id(4), 8);
        assert_eq!(ids(o.iter()), [1, 2, 3, 4]);
        assert_eq!(ids(o.of_scope(7)), [1, 3]);
        o.touch(a);
        assert_eq!(ids(o.iter()), [2, 3, 4, 1]);
        assert_eq!(ids(o.of_scope(7)), [3, 1]);
        o.touch(a); // already last
        assert_eq!(ids(o.iter()), [2, 3, 4, 1]);
        o.remove(d);
        o.remove(b);
        assert_eq!(ids(o.iter()), [3, 1]);
        assert_eq!(ids(o.of_scope(8)), Vec::<u8>::new());
        assert!(!o.scopes.contains_key(&8), "an empty scope is dropped");
        // Freed slots are reused.
        let e = o.push(id(5), 9);
        assert!(e == d || e == b);
        assert_eq!(ids(o.iter()), [3, 1, 5]);
        assert_eq!(ids(o.of_scope(9)), [5]);
        o.remove(c);
        o.remove(a);
        o.remove(e);
        assert_eq!(o.len(), 0);
        assert_eq!(ids(o.iter()), Vec::<u8>::new());
        assert!(o.scopes.is_empty());
    }
}
