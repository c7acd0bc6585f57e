"""The client security settings of `[topic]`, as kafka-python and as librdkafka name them."""

from __future__ import annotations

from cdc.config import TopicConfig


def security_settings(config: TopicConfig) -> dict[str, str]:
    """kafka-python style security keyword arguments from `[topic]` (shared with the admin client)."""
    out: dict[str, str] = {"security_protocol": config.security_protocol}
    if config.sasl_mechanism:
        out["sasl_mechanism"] = config.sasl_mechanism
        out["sasl_plain_username"] = config.sasl_username
        out["sasl_plain_password"] = config.sasl_password
    for key in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
        if getattr(config, key):
            out[key] = getattr(config, key)
    return out


def librdkafka_security(config: TopicConfig) -> dict[str, str]:
    """The same settings as confluent-kafka's (librdkafka's) configuration keys."""
    out = {"security.protocol": config.security_protocol}
    if config.sasl_mechanism:
        out["sasl.mechanism"] = config.sasl_mechanism
        out["sasl.username"] = config.sasl_username
        out["sasl.password"] = config.sasl_password
    for ours, theirs in (
        ("ssl_cafile", "ssl.ca.location"),
        ("ssl_certfile", "ssl.certificate.location"),
        ("ssl_keyfile", "ssl.key.location"),
    ):
        if getattr(config, ours):
            out[theirs] = getattr(config, ours)
    return out
