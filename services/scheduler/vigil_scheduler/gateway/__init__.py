"""The Litestar HTTP gateway, served by the scheduler service."""
