import pytest

from vigil.errors import ConfigError
from vigil_common.settings import Settings


def test_defaults_match_the_contract(monkeypatch):
    for var in ("VIGIL_HTTP_HOST", "VIGIL_HTTP_PORT", "VIGIL_CPU_SLOTS", "VIGIL_DATA_DIR", "VIGIL_NODE_NAME"):
        monkeypatch.delenv(var, raising=False)
    s = Settings.load()
    assert (s.http_host, s.http_port, s.cpu_slots, str(s.data_dir)) == ("127.0.0.1", 8000, 2, ".vigil")
    assert "." not in s.node_name


def test_environment_is_read(monkeypatch):
    monkeypatch.setenv("VIGIL_HTTP_PORT", "9001")
    monkeypatch.setenv("VIGIL_WEBHOOK_URLS", '["https://hooks.example/vigil"]')
    s = Settings.load()
    assert s.http_port == 9001 and s.webhook_urls == ["https://hooks.example/vigil"]


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("VIGIL_HTTP_PORT", "eighty"),
        ("VIGIL_CPU_SLOTS", "0"),
        ("VIGIL_NODE_NAME", "gpu01.cluster"),
        ("VIGIL_NATS_URL", "http://localhost:4222"),
        ("VIGIL_DATABASE_URL", "mysql://x"),
        ("VIGIL_API_TOKEN", "short"),
    ],
)
def test_bad_values_name_the_variable(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=var):
        Settings.load()


def test_flags_override_the_environment(monkeypatch):
    monkeypatch.setenv("VIGIL_HTTP_PORT", "9001")
    assert Settings.load(http_port=9002).http_port == 9002
