//! What a run found, as lines of text or as JSON.

use std::fmt;

use crate::Rule;

/// The verdict on one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// The endpoint did what the rule checks.
    Pass,
    /// The endpoint did something else; the detail says what was sent, what was
    /// expected and what came back.
    Fail,
    /// The rule could not be checked; the detail says what it needs.
    Skip,
}

impl Verdict {
    /// `PASS`, `FAIL` or `SKIP`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
            Verdict::Skip => "SKIP",
        }
    }
}

/// One rule and its verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Outcome {
    /// The rule.
    pub rule: &'static Rule,
    /// Its verdict.
    pub verdict: Verdict,
    /// What was seen, on one line.
    pub detail: String,
}

impl fmt::Display for Outcome {
    /// `PASS|FAIL|SKIP <id> <title> [wire-convention#<section>]: <detail>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} {} [wire-convention#{}]: {}",
            self.verdict.as_str(),
            self.rule.id,
            self.rule.title,
            self.rule.section,
            self.detail
        )
    }
}

/// Every rule's outcome, in the order the rules ran.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// The outcomes.
    pub outcomes: Vec<Outcome>,
}

impl Report {
    pub(crate) fn push(&mut self, rule: &'static Rule, verdict: Verdict, detail: &str) {
        // One line per rule: a detail never breaks the format.
        let detail = detail.replace(['\r', '\n'], " ");
        self.outcomes.push(Outcome {
            rule,
            verdict,
            detail,
        });
    }

    fn count(&self, verdict: Verdict) -> usize {
        self.outcomes
            .iter()
            .filter(|o| o.verdict == verdict)
            .count()
    }

    /// Rules passed.
    pub fn passed(&self) -> usize {
        self.count(Verdict::Pass)
    }

    /// Rules failed.
    pub fn failed(&self) -> usize {
        self.count(Verdict::Fail)
    }

    /// Rules skipped.
    pub fn skipped(&self) -> usize {
        self.count(Verdict::Skip)
    }

    /// The outcome of rule `id`.
    pub fn outcome(&self, id: &str) -> Option<&Outcome> {
        self.outcomes.iter().find(|o| o.rule.id == id)
    }

    /// The ids of the rules with `verdict`.
    pub fn ids(&self, verdict: Verdict) -> Vec<&'static str> {
        self.outcomes
            .iter()
            .filter(|o| o.verdict == verdict)
            .map(|o| o.rule.id)
            .collect()
    }

    /// The summary line: `conformance: N passed, M failed, K skipped`.
    pub fn summary(&self) -> String {
        format!(
            "conformance: {} passed, {} failed, {} skipped",
            self.passed(),
            self.failed(),
            self.skipped()
        )
    }

    /// One line per rule, then the summary line.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        for outcome in &self.outcomes {
            out.push_str(&outcome.to_string());
            out.push('\n');
        }
        out.push_str(&self.summary());
        out.push('\n');
        out
    }

    /// One JSON document: `{"rules": [{"id", "title", "section", "verdict", "detail"}…],
    /// "passed", "failed", "skipped"}`, `verdict` being `pass`, `fail` or `skip`.
    pub fn to_json(&self) -> serde_json::Value {
        let rules: Vec<serde_json::Value> = self
            .outcomes
            .iter()
            .map(|o| {
                serde_json::json!({
                    "id": o.rule.id,
                    "title": o.rule.title,
                    "section": o.rule.section_ref(),
                    "verdict": o.verdict.as_str().to_ascii_lowercase(),
                    "detail": o.detail,
                })
            })
            .collect();
        serde_json::json!({
            "rules": rules,
            "passed": self.passed(),
            "failed": self.failed(),
            "skipped": self.skipped(),
        })
    }
}
