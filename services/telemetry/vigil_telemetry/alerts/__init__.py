"""Alert routes' deliveries (issue 42 §2): which routes an incident goes to (`match`), what is posted
(`formats`), the outbox rows written with the incident's acknowledgement (`outbox`), and the loop that
posts them with retries (`delivery`)."""
