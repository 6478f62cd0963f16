"""`tbmq`: the operator's command line (installed by the bootstrap in .venv/bin).

    tbmq credentials add --username U --password-stdin [--hash-cost standard|low] [--client-id PATTERN] [--cert-cn CN]
                         [--pub F]... [--sub F]...
    tbmq credentials list
    tbmq credentials delete NAME
    tbmq blocked add (--client-id ID | --username U | --ip IP[/BITS] | --regex RE [--target T])
                     [--expires-in SECONDS] [--reason TEXT]
    tbmq blocked list
    tbmq blocked delete KEY
    tbmq tokens revoke (--token-stdin | --jti ID --exp UNIX_SECONDS)
    tbmq tokens list
    tbmq tokens delete JTI
    tbmq login-bans list
    tbmq login-bans lift ADDRESS
    tbmq dead-letters list [--client-id ID]
    tbmq dead-letters replay [--client-id ID] [--after-offset N]

Writes the compacted topics tbmq.security.credentials (key = the username) and tbmq.security.blocked
(key = "<kind>:<value>") that every connector follows: a change applies within a second, to new CONNECTs and
to the next PUBLISH / SUBSCRIBE of connected clients (docs/security.md). `login-bans` lists the addresses the
connectors banned for failed logins (tbmq.security.login.bans) and lifts one on every connector, as the admin
API does. `tokens` revokes MQTT JSON Web Tokens (provider jwt) by their jti before their exp
(tbmq.security.tokens.revoked): every connector refuses them (0x86) and closes the connections they opened;
`tokens revoke --token-stdin` reads the jti and exp from the token itself. `credentials add` of an existing name
replaces it. Passwords are read from stdin and stored only as
argon2id hashes; `credentials list` never prints a hash.

`dead-letters` reads tbmq.msg.persisted.dead: the stored copies for persistent DEVICE clients that Redis refused
for the client's data (device-persistence, docs/device-persistence.md "Dead letters"). `list` prints one JSON line
per dead letter; `replay`, once the client's Redis keys are mended, writes them again to tbmq.msg.persisted with
their place in tbmq.msg.persisted.dead as origin (topics.DEAD_LETTER_ORIGIN_PARTITION), so device-persistence
stores each once per client: a replay run twice stores nothing twice, and a letter at or below the highest one
already replayed for its client is not stored again (replay a client's letters in order); `--after-offset` (the
last offset a replay printed) skips reading the older ones. Kafka: `--bootstrap-servers` (default localhost:9092), the KAFKA_SECURITY_PROTOCOL /
KAFKA_SASL_* settings of the environment, and TBMQ_TOPIC_* when the topics have to be created.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time

from tbmq_auth import (CLIENT_ID, IP, REGEX, REGEX_TARGETS, USERNAME, BlockedRule, Credential, make_credential,
                       revocation, revocation_value, revocations_in_force, revoked_until_ms)
from tbmq_auth.failures import LIFTED, ban_record, bans_in_force, keep_ban
from tbmq_auth.passwords import HASH_COSTS, STANDARD

from .topics import (DEAD_LETTER_ERROR_HEADER, DEAD_LETTER_INSTANCE_HEADER, DEAD_LETTER_ORIGIN_PARTITION, MSG_PERSISTED,
                     MSG_PERSISTED_DEAD, SECURITY_BLOCKED, SECURITY_CREDENTIALS, SECURITY_LOGIN_BANS,
                     SECURITY_TOKENS_REVOKED, spec)


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


async def read_topic(bootstrap: str, topic: str, apply) -> None:
    """Every record of `topic`, from its beginning to its end, handed to apply(key, value)."""
    from .compacted import CompactedTopicView

    await _ensure(bootstrap, topic)
    view = CompactedTopicView(bootstrap, topic, apply, client_id="tbmq-cli")
    await view.start()
    await view.stop()


async def read_table(bootstrap: str, topic: str) -> dict[str, bytes]:
    """The compacted topic as a table (key -> value), read to its end."""
    table: dict[str, bytes] = {}

    def apply(key: bytes, value: bytes | None) -> None:
        if value is None:
            table.pop(key.decode(), None)
        else:
            table[key.decode()] = value

    await read_topic(bootstrap, topic, apply)
    return table


# ------------------------------------------------------------------------------------------------ credentials
def credential_from_args(args, password: str | None) -> Credential:
    try:
        return make_credential(args.username, password, client_id=args.client_id, cert_cn=args.cert_cn,
                               pub=args.pub, sub=args.sub, hash_cost=args.hash_cost)
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


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


async def tokens(args) -> int:
    """`revoke`: the token's jti written with its exp (every connector refuses it and closes its connections
    until then); `list`: one JSON line per revocation whose token has not expired; `delete JTI`: the revocation
    withdrawn."""
    if args.action == "revoke":
        if args.token_stdin and args.jti is not None:
            raise CliError("give either --token-stdin or --jti with --exp")
        try:
            jti, exp = revocation(sys.stdin.readline().strip() if args.token_stdin else None, args.jti, args.exp)
        except ValueError as exc:
            raise CliError(f"{exc} (--token-stdin, or --jti with --exp)") from None
        if exp <= time.time():
            print(f"token {jti!r} expired at {_iso(exp)}: refused anyway, nothing written")
            return 0
        await write(args.bootstrap_servers, SECURITY_TOKENS_REVOKED, jti, revocation_value(exp))
        print(f"token {jti!r} revoked until its expiry, {_iso(exp)}")
    elif args.action == "delete":
        await write(args.bootstrap_servers, SECURITY_TOKENS_REVOKED, args.jti, None)
        print(f"revocation of token {args.jti!r} withdrawn")
    else:
        until_by_jti = {}
        for jti, value in (await read_table(args.bootstrap_servers, SECURITY_TOKENS_REVOKED)).items():
            with contextlib.suppress(ValueError):  # unreadable: no connector applies it either
                until_by_jti[jti] = revoked_until_ms(value)
        for jti, until in revocations_in_force(until_by_jti, time.time() * 1000).items():
            print(json.dumps({"jti": jti, "exp": until // 1000, "until": _iso(until / 1000)}, sort_keys=True))
    return 0


async def login_bans(args) -> int:
    """`list`: one JSON line per ban in force; `lift ADDRESS`: a record ending at LIFTED (every connector takes the
    address's CONNECTs again); exit code 1 when no ban of it is in force."""
    parsed = {}

    def apply(key: bytes | None, value: bytes | None) -> None:
        with contextlib.suppress(ValueError):  # neither a ban nor a failed login: no connector applies it either
            keep_ban(parsed, key, value)

    await read_topic(args.bootstrap_servers, SECURITY_LOGIN_BANS, apply)
    bans = bans_in_force(parsed, int(time.time() * 1000))
    if args.action == "list":
        for ban in bans.values():
            print(json.dumps(ban, sort_keys=True))
        return 0
    if args.address not in bans:
        print(f"no login ban of {args.address!r} in force", file=sys.stderr)
        return 1
    await write(args.bootstrap_servers, SECURITY_LOGIN_BANS, args.address, ban_record(LIFTED, "tbmq-cli"))
    print(f"login ban of {args.address!r} lifted")
    return 0


# ------------------------------------------------------------------------------------------------ dead letters
async def read_records(bootstrap: str, topic: str, after_offset: int = -1):
    """Every record of `topic` above `after_offset`, from its start to the end it had when called, in offset
    order per partition (no consumer group: nothing is committed)."""
    from .kafka import make_consumer, topic_partitions

    await _ensure(bootstrap, topic)
    consumer = make_consumer(bootstrap, group_id=None, client_id="tbmq-cli")
    await consumer.start()
    try:
        tps = await topic_partitions(consumer, topic)
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, max(after_offset + 1, 0))
        left = {tp for tp in tps if await consumer.position(tp) < ends[tp]}
        out = []
        while left:
            for tp, recs in (await consumer.getmany(*left, timeout_ms=1000)).items():
                out += [r for r in recs if r.offset < ends[tp]]
                if await consumer.position(tp) >= ends[tp]:
                    left.discard(tp)
        return out
    finally:
        await consumer.stop()


def dead_letter_row(record) -> dict:
    """One tbmq.msg.persisted.dead record as `dead-letters list` prints it (never the payload)."""
    from tbmq.v1 import messages_pb2 as pb

    headers = {k: v.decode("utf-8", "replace") for k, v in (record.headers or ())}
    row = {"partition": record.partition, "offset": record.offset, "timestamp_ms": record.timestamp,
           "error": headers.get(DEAD_LETTER_ERROR_HEADER, ""), "instance": headers.get(DEAD_LETTER_INSTANCE_HEADER, "")}
    try:
        pm = pb.PersistedMsg.FromString(record.value or b"")
    except Exception:  # DecodeError: shown, not fatal
        return {**row, "client_id": (record.key or b"").decode("utf-8", "replace"), "decode_error": True}
    row.update(client_id=pm.client_id, topic=pm.msg.topic, qos=pm.msg.qos, payload_bytes=len(pm.msg.payload))
    if pm.HasField("origin_offset"):
        row["origin"] = f"{pm.origin_partition}:{pm.origin_offset}"
    return row


def replayed_value(value: bytes, partition: int, offset: int) -> bytes:
    """A dead letter (at `partition` / `offset` of tbmq.msg.persisted.dead) as written back to tbmq.msg.persisted:
    the same copy with that place as its origin (topics.DEAD_LETTER_ORIGIN_PARTITION)."""
    from tbmq.v1 import messages_pb2 as pb

    pm = pb.PersistedMsg.FromString(value)
    pm.origin_partition = DEAD_LETTER_ORIGIN_PARTITION + partition
    pm.origin_offset = offset
    return pm.SerializeToString()


async def dead_letters(args) -> int:
    records = [r for r in await read_records(args.bootstrap_servers, MSG_PERSISTED_DEAD, args.after_offset)
               if args.client_id is None or (r.key or b"").decode("utf-8", "replace") == args.client_id]
    if args.action == "list":
        for r in records:
            print(json.dumps(dead_letter_row(r), sort_keys=True))
        return 0
    from .kafka import make_producer

    await _ensure(args.bootstrap_servers, MSG_PERSISTED)
    producer = make_producer(args.bootstrap_servers, client_id="tbmq-cli")
    await producer.start()
    sent, skipped = [], 0
    try:
        for r in records:
            try:
                value = replayed_value(r.value or b"", r.partition, r.offset)
            except Exception:  # DecodeError: left where it is
                skipped += 1
                continue
            sent.append(await producer.send(MSG_PERSISTED, value, key=r.key))
        await asyncio.gather(*sent)
    finally:
        await producer.stop()
    last = max((r.offset for r in records), default=args.after_offset)
    print(json.dumps({"replayed": len(sent), "undecodable": skipped, "last_offset": last}, sort_keys=True))
    return 0


# ------------------------------------------------------------------------------------------------ parser
def parser() -> argparse.ArgumentParser:
    kafka = argparse.ArgumentParser(add_help=False)
    kafka.add_argument("--bootstrap-servers", default="localhost:9092", help="Kafka (default localhost:9092)")
    p = argparse.ArgumentParser(prog="tbmq",
                                description="tbmq-py administration: credentials, blocked clients, dead letters")
    top = p.add_subparsers(dest="command", required=True)

    c = top.add_parser("credentials", help="MQTT credentials (tbmq.security.credentials)").add_subparsers(
        dest="action", required=True)
    add = c.add_parser("add", parents=[kafka], help="add or replace a credential")
    add.add_argument("--username", required=True, help="the MQTT user name (also the credential's name)")
    add.add_argument("--password-stdin", action="store_true", help="read the password from stdin (one line)")
    add.add_argument("--hash-cost", choices=HASH_COSTS, default=STANDARD,
                     help="argon2id parameters: standard (RFC 9106 low memory, the default) or low (OWASP's minimum: "
                          "about a tenth of the CPU a check, for fleets that reconnect at once; docs/security.md)")
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

    t = top.add_parser("tokens", help="revoked MQTT tokens, provider jwt (tbmq.security.tokens.revoked)")
    t = t.add_subparsers(dest="action", required=True)
    rv = t.add_parser("revoke", parents=[kafka], help="refuse a token before its exp and close its connections")
    rv.add_argument("--token-stdin", action="store_true", help="read the token from stdin: its jti and exp are used")
    rv.add_argument("--jti", help="the token's id (its jti claim)")
    rv.add_argument("--exp", type=float, metavar="UNIX_SECONDS", help="the token's exp claim, with --jti")
    t.add_parser("list", parents=[kafka], help="one JSON line per revoked token not yet expired")
    td = t.add_parser("delete", parents=[kafka], help="withdraw a token's revocation")
    td.add_argument("jti")

    lb = top.add_parser("login-bans", help="addresses banned for failed logins (tbmq.security.login.bans)")
    lba = lb.add_subparsers(dest="action", required=True)
    lba.add_parser("list", parents=[kafka], help="one JSON line per ban in force")
    lift = lba.add_parser("lift", parents=[kafka], help="lift an address's ban on every connector")
    lift.add_argument("address")

    dl = top.add_parser("dead-letters", help="stored copies Redis refused (tbmq.msg.persisted.dead)").add_subparsers(
        dest="action", required=True)
    for action, text in (("list", "one JSON line per dead letter (never the payload)"),
                         ("replay", "write them again to tbmq.msg.persisted (once the client's keys are mended)")):
        a = dl.add_parser(action, parents=[kafka], help=text)
        a.add_argument("--client-id", help="only this client's dead letters")
        a.add_argument("--after-offset", type=int, default=-1, metavar="N",
                       help="only the dead letters above this offset (the last_offset a replay printed)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        command = {"credentials": credentials, "blocked": blocked, "tokens": tokens, "login-bans": login_bans,
                   "dead-letters": dead_letters}[args.command]
        return asyncio.run(command(args))
    except CliError as exc:
        print(f"tbmq: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
