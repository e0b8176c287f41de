"""Tokens and roles: who may call which method, acting as which worker (docs/security.md).

A node started with Options.auth_tokens loads its token store once (`TokenStore.load`); every call
it serves then carries a bearer token, and `Authorizer.authorize(method, token, claimed_worker)`
returns the caller's Principal or raises UnauthenticatedError (no token, or one the store does not
know) / PermissionDeniedError (a method outside the caller's role, or a request acting as another
worker). Roles grow: each grants what the ones before it in ROLES grant.

The store holds SHA-256 hashes of the tokens, never the tokens:

    {"format": "paramserver-tokens", "version": 1,
     "tokens": [{"name": "worker-1", "role": "worker", "worker": 1, "sha256": "<64 hex digits>"}, ...]}

`worker` is the worker index the token may act as (null for a PS or an admin token).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from paramserver.base.errors import ConfigError, ParamServerError, PermissionDeniedError, UnauthenticatedError
from paramserver.security.audit import AuditLog
from paramserver.security.tls import TlsMaterial, tls_from_options

log = logging.getLogger(__name__)
STORE_FORMAT = "paramserver-tokens"
STORE_VERSION = 1
ROLES = ("ps", "worker", "chief", "admin")  # each grants what the ones before it grant
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TOKEN = re.compile(r"[\x21-\x7e]+")  # printable ASCII without spaces: it travels in a gRPC header


@dataclass(frozen=True)
class Principal:
    """Who a call comes from: the token's name, its role, and the worker it may act as (or None)."""

    name: str
    role: str
    worker: int | None = None

    def has(self, role: str) -> bool:
        return ROLES.index(self.role) >= ROLES.index(role)


ANONYMOUS = Principal("anonymous", "admin")  # the caller of a node without a token store: no checks
UNNAMED = Principal("unnamed", "ps")  # a caller without a token, of an open method of a node that checks tokens


@dataclass(frozen=True)
class Action:
    """A method (or one form of it) as the role table sees it."""

    role: str  # the least role that may call it
    audited: bool = False  # an accepted call goes to the audit log too (refusals always do)
    any_worker: bool = False  # its caller may name a worker other than its own (the chief forgetting a dead one)
    form_of: str = ""  # the method this action is a form of (Forget: a Leave), "" for a method itself
    open: bool = False  # callable without a token (Prove: a node shows it holds its run's secret)


@dataclass(frozen=True)
class Claim:
    """What a request asks for, as its service reads it: the action (a method, or a form of one, e.g.
    "Forget" for a Leave that declares a worker gone), the worker it acts as, and audit details."""

    action: str
    worker: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)


_WORKER, _CHIEF = Action("worker"), Action("chief", audited=True)
# The chief runs the mode schedule the operator gave it and tells the shards of dead workers, with its
# own token: mode switches and Forget are chief actions (an admin may do them too). docs/security.md.
SHARD_ACTIONS: dict[str, Action] = {
    "Hello": Action("ps"),
    "Prove": Action("ps", open=True),  # asked before any token is sent to the node (security/run_secret.py)
    "Register": _WORKER,
    "PushPull": _WORKER,
    "RegisterTable": _WORKER,
    "Lookup": _WORKER,
    "Probe": _WORKER,
    "Leave": _WORKER,
    "Forget": Action("chief", audited=True, any_worker=True, form_of="Leave"),
    "SetMode": _CHIEF,
    "Checkpoint": _CHIEF,
    "Assign": _CHIEF,
    "Shutdown": Action("admin", audited=True),
    "Restart": Action("chief", audited=True, form_of="Shutdown"),  # a Shutdown with `restart`: the chief's roll-back
    "End": Action("chief", audited=True, form_of="Shutdown"),  # a Shutdown with `end`: the run completed
}
COORDINATOR_ACTIONS: dict[str, Action] = {
    "Hello": Action("ps"),
    "Prove": Action("ps", open=True),
    "Join": Action("worker", audited=True),
    "Heartbeat": _WORKER,
    "Finish": Action("worker", audited=True),
    "Barrier": _WORKER,
    "Leave": Action("worker", audited=True),
    "RequestCheckpoint": _CHIEF,
    "Split": _WORKER,
}


@dataclass(frozen=True)
class Credentials:
    """What a node shows on every channel it opens: TLS material and its token (either may be None)."""

    tls: TlsMaterial | None = None
    token: str | None = None

    @classmethod
    def from_options(cls, options) -> Credentials:
        """From Options.tls_* and Options.token_file (files read now, once)."""
        return cls(tls_from_options(options), read_token(options.token_file) if options.token_file else None)

    @property
    def metadata(self) -> tuple | None:
        """The gRPC call metadata carrying the token, or None without one."""
        return bearer_metadata(self.token)


NO_CREDENTIALS = Credentials()  # plaintext, no token (frozen: safe to share)


def bearer_metadata(token: str | None) -> tuple | None:
    """gRPC call metadata ("authorization", "Bearer <token>"), or None without a token."""
    return (("authorization", f"Bearer {token}"),) if token else None


def bearer_token(metadata) -> str | None:
    """The token of an ("authorization", "Bearer <token>") entry of gRPC call metadata, if any."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer ") :]
    return None


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def read_token(path: str | Path) -> str:
    """The token a node presents (Options.token_file), read once when it starts."""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read token file {path}: {exc}") from None
    if not _TOKEN.fullmatch(token):
        raise ConfigError(f"token file {path} must hold one token of printable ASCII without spaces")
    return token


class TokenStore:
    """The accepted tokens (by hash) and their principals."""

    def __init__(self, entries: list[tuple[str, Principal]]) -> None:
        self._entries = entries  # (sha256 hex, principal)

    @classmethod
    def load(cls, path: str | Path) -> TokenStore:
        """Read and check a store file (Options.auth_tokens); one ConfigError names every problem."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(f"cannot read token store {path}: {exc}") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: Any, source: str = "token store") -> TokenStore:
        if not isinstance(data, dict) or data.get("format") != STORE_FORMAT or data.get("version") != STORE_VERSION:
            raise ConfigError(
                f'{source}: not a token store (want an object with "format": {STORE_FORMAT!r}, '
                f'"version": {STORE_VERSION} and "tokens")'
            )
        tokens = data.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ConfigError(f"{source}: 'tokens' must be a non-empty list")
        problems: list[str] = []
        entries = [entry for i, raw in enumerate(tokens) if (entry := _entry(raw, i, problems)) is not None]
        for what, values in (("name", [p.name for _, p in entries]), ("sha256", [h for h, _ in entries])):
            twice = sorted({v for v in values if values.count(v) > 1})
            if twice:
                problems.append(f"{what} given more than once: {twice}")
        if problems:
            raise ConfigError(f"{source}: " + "; ".join(problems))
        return cls(entries)

    def find(self, token: str) -> Principal | None:
        """The token's principal. Compares with every entry in constant time (no early exit)."""
        digest, found = token_hash(token), None
        for stored, principal in self._entries:
            if hmac.compare_digest(stored, digest):
                found = principal
        return found

    def __len__(self) -> int:
        return len(self._entries)


def _entry(raw: Any, i: int, problems: list[str]) -> tuple[str, Principal] | None:
    if not isinstance(raw, dict):
        problems.append(f"tokens[{i}] must be an object, got {raw!r}")
        return None
    name, role, worker, digest = raw.get("name"), raw.get("role"), raw.get("worker"), raw.get("sha256")
    before = len(problems)
    if not isinstance(name, str) or not name:
        problems.append(f"tokens[{i}].name must be a non-empty string, got {name!r}")
    if role not in ROLES:
        problems.append(f"tokens[{i}].role must be one of {list(ROLES)}, got {role!r}")
    if worker is not None and (type(worker) is not int or worker < 0):
        problems.append(f"tokens[{i}].worker must be null or a worker index (0 or more), got {worker!r}")
    elif role in ("worker", "chief") and worker is None:
        problems.append(f"tokens[{i}].worker is needed for role {role!r} (the worker index it acts as)")
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        problems.append(f"tokens[{i}].sha256 must be 64 lower-case hex digits (the token's SHA-256)")
    if len(problems) > before:
        return None
    # no new problem: name, role and digest passed the checks above, so all three are strings
    return cast(str, digest), Principal(cast(str, name), cast(str, role), worker)


class Authorizer:
    """The role table of one service (SHARD_ACTIONS or COORDINATOR_ACTIONS) over a token store."""

    def __init__(self, store: TokenStore, actions: Mapping[str, Action]) -> None:
        self.store = store
        self.actions = actions

    def authenticate(self, token: str | None) -> Principal:
        if not token:
            raise UnauthenticatedError("the call carries no token; this node accepts only known tokens")
        principal = self.store.find(token)
        if principal is None:
            raise UnauthenticatedError("the call's token is not known to this node")
        return principal

    def permit(self, principal: Principal, action: str, claimed_worker: int | None) -> None:
        rule = self.actions.get(action)
        if rule is None:
            raise PermissionDeniedError(f"{action!r} is not a method of this node's role table")
        if not principal.has(rule.role):
            raise PermissionDeniedError(
                f"{principal.name} (role {principal.role}) may not call {action}: it needs role {rule.role}"
            )
        acts_as_other = claimed_worker is not None and claimed_worker != principal.worker
        if acts_as_other and not (rule.any_worker or principal.has("admin")):
            raise PermissionDeniedError(
                f"{principal.name} may act only as worker {principal.worker}, not as worker {claimed_worker}"
            )

    def permit_method(self, principal: Principal, method: str) -> None:
        """Whether `principal`'s role may call `method` in any of its forms (a Leave that is a Forget,
        a Shutdown that is a Restart): what can be known before the request is read. A method outside
        the role table passes: the transport answers it UNIMPLEMENTED."""
        roles = [rule.role for name, rule in self.actions.items() if method in (name, rule.form_of)]
        if roles and not any(principal.has(role) for role in roles):
            least = min(roles, key=ROLES.index)
            raise PermissionDeniedError(
                f"{principal.name} (role {principal.role}) may not call {method}: it needs role {least}"
            )

    def authorize(self, method: str, token: str | None, claimed_worker: int | None = None) -> Principal:
        """The caller's Principal, if `token` may call `method` acting as `claimed_worker`."""
        principal = self.authenticate(token)
        self.permit(principal, method, claimed_worker)
        return principal


class Guard:
    """What a node checks and records around every call it serves (transport/dispatch.py): the
    authorizer (None: no checks) and the audit log (None: nothing recorded)."""

    def __init__(
        self, actions: Mapping[str, Action], authorizer: Authorizer | None = None, audit: AuditLog | None = None
    ) -> None:
        self.actions = actions
        self.authorizer = authorizer
        self.audit = audit

    @classmethod
    def from_options(cls, options, node: str, actions: Mapping[str, Action]) -> Guard:
        """A node's guard from Options.auth_tokens and Options.audit_log (files read or opened now)."""
        store = TokenStore.load(options.auth_tokens) if options.auth_tokens else None
        authorizer = Authorizer(store, actions) if store is not None else None
        if store is not None:
            log.info("%s: %d token(s) accepted from %s", node, len(store), options.auth_tokens)
        return cls(actions, authorizer, AuditLog.open(options.audit_log, node))

    @property
    def checks(self) -> bool:
        return self.authorizer is not None

    def authenticate(self, token: str | None, method: str = "") -> Principal:
        """The caller of `method` (a call without a token, of an open method, is UNNAMED)."""
        if self.authorizer is None:
            return ANONYMOUS
        rule = self.actions.get(method)
        if not token and rule is not None and rule.open:
            return UNNAMED
        return self.authorizer.authenticate(token)

    def permit_method(self, principal: Principal, method: str) -> None:
        """What can be checked before a request is read: may `principal` call `method` in some form?"""
        if self.authorizer is not None:
            self.authorizer.permit_method(principal, method)

    def needs_claim(self, method: str) -> bool:
        """Whether the request must be read before it is served (to authorize it, or to audit it)."""
        rule = self.actions.get(method)
        # a Leave is read too: it may be a Forget, which is audited
        audited = rule is not None and (rule.audited or rule.role == "admin") or method == "Leave"
        return self.checks or (self.audit is not None and audited)

    def permit(self, principal: Principal, claim: Claim) -> None:
        if self.authorizer is not None:
            self.authorizer.permit(principal, claim.action, claim.worker)

    def record(
        self, method: str, claim: Claim | None, principal: Principal, peer: str, error: ParamServerError | None
    ) -> None:
        """Audit a refused call, or an accepted one whose action is audited or outside the worker role."""
        if self.audit is None:
            return
        action = claim.action if claim is not None else method
        rule = self.actions.get(action)
        if error is None and not (rule is not None and (rule.audited or rule.role == "admin")):
            return
        detail = dict(claim.detail) if claim is not None else {}
        if claim is not None and claim.worker is not None:
            detail["worker"] = claim.worker
        if error is not None:
            detail["message"] = str(error)
        self.audit.record(action, "ok" if error is None else error.code.name, principal.name, peer, detail)

    def close(self) -> None:
        if self.audit is not None:
            self.audit.close()
