from vigil.events import IncidentRaised
from vigil_guardian.oversize import MAX_TRUNCATED_BYTES, truncated


def incident(**evidence: object) -> IncidentRaised:
    return IncidentRaised(
        job_id="j", attempt=1, kind="nan", action="replay", message="m" * 2_000_000, evidence=evidence
    )


def test_a_huge_incident_is_cut_to_fit_and_marked() -> None:
    big = incident(culprits=list(range(60_000)), outcome="transient", nested={str(i): i for i in range(500)})
    cut = truncated(big)
    assert len(cut.to_bytes()) <= MAX_TRUNCATED_BYTES
    assert cut.evidence["truncated"] is True and cut.evidence["original_bytes"] == len(big.to_bytes())
    assert cut.evidence["outcome"] == "transient"
    assert cut.evidence["culprits"][:3] == [0, 1, 2] and cut.evidence["culprits"][-1] == "... 59984 more"
    assert cut.message.endswith("(2,000,000 characters, truncated)")
    assert (cut.event_id, cut.kind, cut.action) == (big.event_id, big.kind, big.action)


def test_evidence_too_wide_even_when_cut_keeps_only_its_keys() -> None:
    wide = incident(**{f"k{i}": ["v" * 1000] * 100 for i in range(60)})  # 16 x 16 x 500 chars once cut
    cut = truncated(wide)
    assert len(cut.to_bytes()) <= MAX_TRUNCATED_BYTES
    assert cut.evidence == {
        "truncated": True,
        "original_bytes": len(wide.to_bytes()),
        "keys": [f"k{i}" for i in range(16)],
    }


def test_a_refused_report_is_an_alert_naming_the_field_and_the_count() -> None:
    from tests.unit.common.samples import SAMPLES
    from vigil.events import ReportRefused
    from vigil_guardian.watch import report_refused

    fact = SAMPLES[ReportRefused]
    d = report_refused(fact)
    assert (d.incident.kind, d.action, d.commands) == ("report_refused", "alert", ())
    assert d.incident.evidence == {"report": fact.report, "field": "culprits", "refused": 3}
    assert "culprits" in d.incident.message and "(3 refusals)" in d.incident.message
    assert report_refused(fact).incident.event_id == d.incident.event_id  # a redelivery: the same incident
