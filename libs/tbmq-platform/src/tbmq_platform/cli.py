"""`tbmq`: the operator's command line (installed by the bootstrap in .venv/bin).

    tbmq credentials add --username U --password-stdin [--client-id PATTERN] [--cert-cn CN] [--pub F]... [--sub F]...
    tbmq credentials list
    tbmq credentials delete NAME
    tbmq blocked add (--client-id ID | --username U | --ip IP[/BITS] | --regex RE [--target T])
                     [--expires-in SECONDS] [--reason TEXT]
    tbmq blocked list
    tbmq blocked delete KEY

Writes the compacted topics tbmq.security.credentials (key = the username) and tbmq.security.blocked
(key = "<kind>:<value>") that every connector follows: a change applies within a second, to new CONNECTs and
to the next PUBLISH / SUBSCRIBE of connected clients (docs/security.md). `credentials add` of an existing
name replaces it. Passwords are read from stdin and stored only as argon2id hashes; `credentials list`
never prints a hash. Kafka: `--bootstrap-servers` (default localhost:9092), the KAFKA_SECURITY_PROTOCOL /
KAFKA_SASL_* settings of the environment, and TBMQ_TOPIC_* when the topics have to be created.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from tbmq_auth import CLIENT_ID, IP, REGEX, REGEX_TARGETS, USERNAME, BlockedRule, Credential, make_credential

from .topics import SECURITY_BLOCKED, SECURITY_CREDENTIALS, spec


class CliError(Exception):
    pass


async def _ensure(bootstrap: str, topic: str) -> None:
    from .kafka import configure_security, ensure_topics
    from .settings import CommonSettings, load_or_exit

    settings = load_or_exit(CommonSettings)
    configure_security(settings.kafka_security)
    await ensure_topics(bootstrap, [spec(topic)], layout=settings.topic_layout)


async def write(bootstrap: str, topic: str, key: str, value: bytes | None) -> None:
    """One record (None = a tombstone), acknowledged by Kafka (acks=all) before returning."""
    from .kafka import make_producer

    await _ensure(bootstrap, topic)
    producer = make_producer(bootstrap, client_id="tbmq-cli")
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key=key.encode())
    finally:
        await producer.stop()


async def read_table(bootstrap: str, topic: str) -> dict[str, bytes]:
    """The compacted topic as a table (key -> value), read to its end."""
    from .compacted import CompactedTopicView

    await _ensure(bootstrap, topic)
    table: dict[str, bytes] = {}

    def apply(key: bytes, value: bytes | None) -> None:
        if value is None:
            table.pop(key.decode(), None)
        else:
            table[key.decode()] = value

    view = CompactedTopicView(bootstrap, topic, apply, client_id="tbmq-cli")
    await view.start()
    await view.stop()
    return table


# ------------------------------------------------------------------------------------------------ credentials
def credential_from_args(args, password: str | None) -> Credential:
    try:
        return make_credential(args.username, password, client_id=args.client_id, cert_cn=args.cert_cn,
                               pub=args.pub, sub=args.sub)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def read_password(stream) -> str:
    line = stream.readline()
    return line[:-1] if line.endswith("\n") else line


async def credentials(args) -> int:
    if args.action == "add":
        password = read_password(sys.stdin) if args.password_stdin else None
        cred = credential_from_args(args, password)
        await write(args.bootstrap_servers, SECURITY_CREDENTIALS, cred.name, cred.to_json())
        print(f"credential {cred.name!r} written")
    elif args.action == "delete":
        await write(args.bootstrap_servers, SECURITY_CREDENTIALS, args.name, None)
        print(f"credential {args.name!r} deleted")
    else:
        table = await read_table(args.bootstrap_servers, SECURITY_CREDENTIALS)
        for name in sorted(table):
            try:
                shown = Credential.from_json(name, table[name]).public()
            except (ValueError, TypeError, AttributeError):
                shown = {"username": name, "error": "unreadable record"}
            print(json.dumps(shown, sort_keys=True))
    return 0


# ------------------------------------------------------------------------------------------------ blocked
def rule_from_args(args, now_ms: int) -> BlockedRule:
    given = [(k, v) for k, v in ((CLIENT_ID, args.client_id), (USERNAME, args.username), (IP, args.ip),
                                 (REGEX, args.regex)) if v is not None]
    if len(given) != 1:
        raise CliError("give exactly one of --client-id, --username, --ip, --regex")
    kind, value = given[0]
    expires = None if args.expires_in is None else now_ms + int(args.expires_in * 1000)
    try:
        return BlockedRule(kind=kind, value=value, target=args.target, expires_at_ms=expires, reason=args.reason)
    except ValueError as exc:  # a bad regex (re.error) or network
        raise CliError(f"{value!r}: {exc}") from None


async def blocked(args) -> int:
    if args.action == "add":
        rule = rule_from_args(args, int(time.time() * 1000))
        await write(args.bootstrap_servers, SECURITY_BLOCKED, rule.key, rule.to_json())
        print(f"blocked {rule.key!r}" + ("" if rule.expires_at_ms is None else
                                         f" until {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(rule.expires_at_ms / 1000))}"))
    elif args.action == "delete":
        await write(args.bootstrap_servers, SECURITY_BLOCKED, args.key, None)
        print(f"blocked rule {args.key!r} deleted")
    else:
        table = await read_table(args.bootstrap_servers, SECURITY_BLOCKED)
        now = int(time.time() * 1000)
        for key in sorted(table):
            d = json.loads(table[key])
            d["key"] = key
            d["active"] = d.get("expires_at_ms") is None or now < d["expires_at_ms"]
            print(json.dumps(d, sort_keys=True))
    return 0


# ------------------------------------------------------------------------------------------------ parser
def parser() -> argparse.ArgumentParser:
    kafka = argparse.ArgumentParser(add_help=False)
    kafka.add_argument("--bootstrap-servers", default="localhost:9092", help="Kafka (default localhost:9092)")
    p = argparse.ArgumentParser(prog="tbmq", description="tbmq-py administration: credentials and blocked clients")
    top = p.add_subparsers(dest="command", required=True)

    c = top.add_parser("credentials", help="MQTT credentials (tbmq.security.credentials)").add_subparsers(
        dest="action", required=True)
    add = c.add_parser("add", parents=[kafka], help="add or replace a credential")
    add.add_argument("--username", required=True, help="the MQTT user name (also the credential's name)")
    add.add_argument("--password-stdin", action="store_true", help="read the password from stdin (one line)")
    add.add_argument("--client-id", help="client ids this credential may use (shell pattern: *, ?, [..]; %%u = username)")
    add.add_argument("--cert-cn", help="a client certificate whose CN or SAN is this authenticates as this credential")
    add.add_argument("--pub", action="append", default=[], metavar="FILTER",
                     help="may publish to topics this filter matches (%%c client id, %%u username; repeatable)")
    add.add_argument("--sub", action="append", default=[], metavar="FILTER",
                     help="may subscribe to filters this one covers ('#' and '$SYS/#' only when given; repeatable)")
    c.add_parser("list", parents=[kafka], help="list credentials (never their hashes)")
    d = c.add_parser("delete", parents=[kafka], help="delete a credential")
    d.add_argument("name")

    b = top.add_parser("blocked", help="blocked clients (tbmq.security.blocked)").add_subparsers(
        dest="action", required=True)
    badd = b.add_parser("add", parents=[kafka], help="block clients (CONNACK 0x8A / 3.x: 5)")
    badd.add_argument("--client-id")
    badd.add_argument("--username")
    badd.add_argument("--ip", help="an address or a network (10.0.0.0/8)")
    badd.add_argument("--regex", help="a regular expression the whole --target must match")
    badd.add_argument("--target", default=CLIENT_ID, choices=REGEX_TARGETS, help="what --regex matches")
    badd.add_argument("--expires-in", type=float, metavar="SECONDS", help="the rule ends after this (default never)")
    badd.add_argument("--reason", default="")
    b.add_parser("list", parents=[kafka], help="list blocked rules")
    bd = b.add_parser("delete", parents=[kafka], help="delete a blocked rule by its key (see list)")
    bd.add_argument("key")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return asyncio.run(credentials(args) if args.command == "credentials" else blocked(args))
    except CliError as exc:
        print(f"tbmq: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
