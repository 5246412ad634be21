use std::cell::RefCell;
use std::fmt;
use std::sync::{Arc, OnceLock};

use http::{HeaderMap, HeaderName, Method, Uri};
use sha2::{Digest, Sha256};

use crate::wire::IdempotencyKey;

/// Feeds length-prefixed fields into a SHA-256 behind a domain separator, so that no two
/// different field lists hash alike.
#[derive(Clone)]
pub(crate) struct Hasher(Sha256);

impl Hasher {
    pub(crate) fn new(domain: &str) -> Self {
        let mut h = Hasher(Sha256::new());
        h.field(domain.as_bytes());
        h
    }

    pub(crate) fn field(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.update((bytes.len() as u64).to_be_bytes());
        self.0.update(bytes);
        self
    }

    pub(crate) fn finish(self) -> [u8; 32] {
        self.0.finalize().into()
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// The authenticated identity a request belongs to.
///
/// The user's authentication layer inserts it as a request extension; the
/// `IdempotencyLayer` derives the record's [`Scope`] from it, so the same key sent by
/// two principals names two independent records.
///
/// ```
/// use retrysafe::idempotency::{Principal, Scope};
/// let alice = Principal::new("alice");
/// assert_eq!(alice.as_str(), "alice");
/// assert_ne!(Scope::from(&alice), Scope::from(&Principal::new("bob")));
/// ```
#[derive(Clone)]
pub struct Principal(Arc<Named>);

/// A principal's name and label, and its scope once a layer asked for it: the scope's
/// SHA-256 is computed once per principal, not once per request that clones it.
struct Named {
    id: Box<str>,
    label: Option<Arc<str>>,
    scope: OnceLock<Scope>,
}

impl Principal {
    fn named(id: String, label: Option<Arc<str>>) -> Self {
        Principal(Arc::new(Named {
            id: id.into_boxed_str(),
            label,
            scope: OnceLock::new(),
        }))
    }

    /// A principal named `id`. Only its hash is ever stored.
    pub fn new(id: impl Into<String>) -> Self {
        Principal::named(id.into(), None)
    }

    /// A principal named `id` with a `label` that may be stored beside its records and
    /// shown to a resolver, a reconcile hook and an operator (a tenant's name, say).
    /// The label does not take part in the scope: the same `id` with any label is the
    /// same scope. Never use a credential as the label.
    ///
    /// ```
    /// use retrysafe::idempotency::{Principal, Scope};
    /// let p = Principal::with_label("tenant-7f3a", "Acme Corp");
    /// assert_eq!(p.label(), Some("Acme Corp"));
    /// assert_eq!(Scope::from(&p), Scope::from(&Principal::new("tenant-7f3a")));
    /// ```
    pub fn with_label(id: impl Into<String>, label: impl Into<String>) -> Self {
        Principal::named(id.into(), Some(Arc::from(label.into())))
    }

    /// The principal's name.
    pub fn as_str(&self) -> &str {
        &self.0.id
    }

    /// The label given with [`Principal::with_label`], if any.
    pub fn label(&self) -> Option<&str> {
        self.0.label.as_deref()
    }

    /// The label, shared.
    #[doc(hidden)]
    pub fn label_arc(&self) -> Option<Arc<str>> {
        self.0.label.clone()
    }
}

impl PartialEq for Principal {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
            || (self.as_str() == other.as_str() && self.label() == other.label())
    }
}

impl Eq for Principal {}

impl std::hash::Hash for Principal {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
        self.label().hash(state);
    }
}

impl fmt::Debug for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Principal")
            .field("id", &self.as_str())
            .field("label", &self.label())
            .finish()
    }
}

/// The scope of a record: a SHA-256 of an identity, behind a domain separator.
///
/// Records of different scopes are independent: a key is never replayed across scopes.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Scope([u8; 32]);

impl Scope {
    /// The scope named by arbitrary bytes (hashed).
    pub fn new(id: impl AsRef<[u8]>) -> Self {
        let mut h = Hasher::new("retrysafe/v1/scope");
        h.field(id.as_ref());
        Scope(h.finish())
    }

    /// One scope shared by every request (an explicit opt-in: keys of all callers
    /// collide in it). It has a hash domain of its own, so no bytes given to
    /// [`Scope::new`] (by a `scope_by` rule fed from request data, say) can name it.
    pub fn global() -> Self {
        Scope(Hasher::new("retrysafe/v1/scope/global").finish())
    }

    /// The scope of an `Authorization` header value (hashed). Unsafe with rotating or
    /// signed credentials (SigV4, refreshed OAuth tokens): a retry with a new credential
    /// lands in a new scope and runs again.
    #[doc(hidden)]
    pub fn from_authorization(value: &[u8]) -> Self {
        let mut h = Hasher::new("retrysafe/v1/scope/authorization");
        h.field(value);
        Scope(h.finish())
    }

    /// The hash.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The scope whose hash is `hash` (as [`as_bytes`](Self::as_bytes) gave it), as a
    /// store reads it back.
    pub fn from_hash(hash: [u8; 32]) -> Self {
        Scope(hash)
    }
}

impl From<&Principal> for Scope {
    fn from(p: &Principal) -> Self {
        *p.0.scope.get_or_init(|| {
            let mut h = Hasher::new("retrysafe/v1/scope/principal");
            h.field(p.as_str().as_bytes());
            Scope(h.finish())
        })
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Scope({})", hex(self.0.get(..8).unwrap_or(&[])))
    }
}

/// The record-id hash fed with its domain and `scope`. Those fill the first SHA-256
/// block, so the state after them (one compressed block) is the same for every key of
/// the scope.
fn record_prefix(scope: &Scope) -> Hasher {
    let mut h = Hasher::new("retrysafe/v1/record");
    h.field(scope.as_bytes());
    h
}

thread_local! {
    /// The last scope a record id was made for on this thread, and its
    /// [`record_prefix`]: the requests of one scope in a row hash one block less.
    static RECORD_PREFIX: RefCell<Option<(Scope, Hasher)>> = const { RefCell::new(None) };
}

/// The key of one record: a SHA-256 of (scope, idempotency key).
///
/// ```
/// use retrysafe::idempotency::{Principal, RecordId, Scope};
/// use retrysafe::wire::IdempotencyKey;
/// let key = IdempotencyKey::new("k-1").unwrap();
/// let a = RecordId::new(&Scope::from(&Principal::new("a")), &key);
/// let b = RecordId::new(&Scope::from(&Principal::new("b")), &key);
/// assert_ne!(a, b);
/// assert_eq!(a.to_hex().len(), 64);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordId([u8; 32]);

impl RecordId {
    /// The record key of `key` in `scope`.
    pub fn new(scope: &Scope, key: &IdempotencyKey) -> Self {
        let mut h = RECORD_PREFIX
            .try_with(|last| {
                let mut last = last.borrow_mut();
                match &*last {
                    Some((of, prefix)) if of == scope => prefix.clone(),
                    _ => {
                        let prefix = record_prefix(scope);
                        *last = Some((*scope, prefix.clone()));
                        prefix
                    }
                }
            })
            .unwrap_or_else(|_| record_prefix(scope));
        h.field(key.as_str().as_bytes());
        RecordId(h.finish())
    }

    /// Rebuilds a record id from its bytes (as a store persisted them).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        RecordId(bytes)
    }

    /// The hash.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lowercase hex, 64 characters: the form stores use in key names.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

impl fmt::Debug for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecordId({})", hex(self.0.get(..8).unwrap_or(&[])))
    }
}

/// The random 128-bit token of one claim. Completion, release, renewal and the commit
/// point carry it; a store compares tokens for equality and refuses stale ones.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token(u128);

impl Token {
    /// A fresh random token.
    pub fn random() -> Self {
        Token(rand::random())
    }

    /// A token from its 16 big-endian bytes.
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        Token(u128::from_be_bytes(bytes))
    }

    /// The 16 big-endian bytes.
    pub fn to_bytes(self) -> [u8; 16] {
        self.0.to_be_bytes()
    }

    /// Lowercase hex, 32 characters.
    #[doc(hidden)]
    pub fn to_hex(self) -> String {
        hex(&self.to_bytes())
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Only a prefix: tokens are capabilities.
        write!(
            f,
            "Token({}…)",
            hex(self.to_bytes().get(..4).unwrap_or(&[]))
        )
    }
}

/// What a repeated request must match: a SHA-256 of method, path, query, the configured
/// headers and the body.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// No request's fingerprint (all zero bytes): what a record that keeps none reports.
    #[doc(hidden)]
    pub const NONE: Fingerprint = Fingerprint([0; 32]);

    /// A fingerprint from its bytes (as a store persisted them).
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Fingerprint(bytes)
    }

    /// The hash.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", hex(self.0.get(..8).unwrap_or(&[])))
    }
}

/// Computes request [`Fingerprint`]s: method, path, query, the configured headers (by
/// default `content-type`; all values of a header, in order) and the body.
///
/// ```
/// use retrysafe::idempotency::Fingerprinter;
/// use http::{HeaderMap, Method, Uri};
///
/// let fp = Fingerprinter::default();
/// let uri: Uri = "/payments?x=1".parse().unwrap();
/// let a = fp.fingerprint(&Method::POST, &uri, &HeaderMap::new(), b"{\"amount\":1}");
/// let b = fp.fingerprint(&Method::POST, &uri, &HeaderMap::new(), b"{\"amount\":2}");
/// assert_ne!(a, b);
/// assert_eq!(a, fp.fingerprint(&Method::POST, &uri, &HeaderMap::new(), b"{\"amount\":1}"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprinter {
    headers: Vec<HeaderName>,
}

impl Default for Fingerprinter {
    fn default() -> Self {
        Fingerprinter {
            headers: vec![http::header::CONTENT_TYPE],
        }
    }
}

impl Fingerprinter {
    /// A fingerprinter over the given headers (in addition to method, path, query, body).
    pub fn with_headers(headers: impl IntoIterator<Item = HeaderName>) -> Self {
        Fingerprinter {
            headers: headers.into_iter().collect(),
        }
    }

    /// The headers that are part of the fingerprint.
    #[doc(hidden)]
    pub fn headers(&self) -> &[HeaderName] {
        &self.headers
    }

    /// The fingerprint of a request.
    pub fn fingerprint(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Fingerprint {
        let mut h = Hasher::new("retrysafe/v1/fingerprint");
        h.field(method.as_str().as_bytes())
            .field(uri.path().as_bytes())
            .field(uri.query().unwrap_or("").as_bytes());
        for name in &self.headers {
            h.field(name.as_str().as_bytes());
            let values = headers.get_all(name);
            h.field(&(values.iter().count() as u64).to_be_bytes());
            for v in values {
                h.field(v.as_bytes());
            }
        }
        h.field(body);
        Fingerprint(h.finish())
    }
}

/// Derives a deterministic child idempotency key: `H(scope, key, label, sequence)`.
pub(crate) fn child_key(
    scope: &Scope,
    key: &IdempotencyKey,
    label: &str,
    seq: u64,
) -> IdempotencyKey {
    let mut h = Hasher::new("retrysafe/v1/child-key");
    h.field(scope.as_bytes())
        .field(key.as_str().as_bytes())
        .field(label.as_bytes())
        .field(&seq.to_be_bytes());
    let digest = h.finish();
    let s = format!("rs1-{}", hex(digest.get(..16).unwrap_or(&[])));
    // "rs1-" and 32 hex digits: always a valid key.
    IdempotencyKey::new(&s).expect("a child key is printable ascii")
}
