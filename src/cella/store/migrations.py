"""Ordered schema migrations; `PRAGMA user_version` records how many have run."""

MIGRATIONS: list[str] = [
    """
    CREATE TABLE api_keys (
        id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        hash TEXT NOT NULL UNIQUE,
        admin INTEGER NOT NULL DEFAULT 0,
        created_at TEXT NOT NULL,
        revoked_at TEXT
    );
    CREATE TABLE sandboxes (
        id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        state TEXT NOT NULL,
        template TEXT NOT NULL,
        vcpus INTEGER NOT NULL,
        memory_mib INTEGER NOT NULL,
        disk_mib INTEGER,
        ttl_seconds INTEGER,
        idle_timeout_seconds INTEGER,
        labels TEXT NOT NULL DEFAULT '{}',
        accel TEXT,
        accel_reason TEXT,
        error TEXT,
        pid INTEGER,
        created_at TEXT NOT NULL,
        updated_at TEXT NOT NULL
    );
    CREATE INDEX sandboxes_tenant ON sandboxes (tenant, state);
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        sandbox_id TEXT NOT NULL,
        type TEXT NOT NULL,
        at TEXT NOT NULL,
        data TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX events_sandbox ON events (sandbox_id, id);
    """,
    """
    ALTER TABLE sandboxes ADD COLUMN disk TEXT NOT NULL DEFAULT 'disk.qcow2';
    ALTER TABLE sandboxes ADD COLUMN parent_id TEXT;
    ALTER TABLE sandboxes ADD COLUMN snapshot_id TEXT;
    ALTER TABLE sandboxes ADD COLUMN base_snapshot_id TEXT;
    ALTER TABLE sandboxes ADD COLUMN created_from TEXT;
    CREATE TABLE snapshots (
        id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        name TEXT NOT NULL,
        sandbox_id TEXT NOT NULL,
        parent_snapshot_id TEXT,
        state TEXT NOT NULL,
        template TEXT NOT NULL,
        vcpus INTEGER NOT NULL,
        memory_mib INTEGER NOT NULL,
        size_bytes INTEGER,
        paused_ms REAL,
        error TEXT,
        created_at TEXT NOT NULL,
        updated_at TEXT NOT NULL
    );
    CREATE INDEX snapshots_tenant ON snapshots (tenant, state);
    """,
    """
    ALTER TABLE sandboxes ADD COLUMN ttl_action TEXT NOT NULL DEFAULT 'delete';
    ALTER TABLE sandboxes ADD COLUMN idle_action TEXT NOT NULL DEFAULT 'stop';
    ALTER TABLE sandboxes ADD COLUMN max_pids INTEGER;
    ALTER TABLE sandboxes ADD COLUMN last_active_at TEXT;
    """,
    """
    ALTER TABLE sandboxes ADD COLUMN network TEXT NOT NULL DEFAULT '{"allow": [], "deny": []}';
    ALTER TABLE sandboxes ADD COLUMN secrets TEXT NOT NULL DEFAULT '{}';
    CREATE TABLE secrets (
        tenant TEXT NOT NULL,
        name TEXT NOT NULL,
        value TEXT NOT NULL,
        hosts TEXT NOT NULL,
        auth TEXT,
        username TEXT,
        created_at TEXT NOT NULL,
        updated_at TEXT NOT NULL,
        PRIMARY KEY (tenant, name)
    );
    CREATE INDEX events_type ON events (sandbox_id, type, id);
    """,
    """
    ALTER TABLE secrets ADD COLUMN inject TEXT NOT NULL DEFAULT 'anywhere';
    """,
    """
    ALTER TABLE sandboxes ADD COLUMN name TEXT;
    ALTER TABLE sandboxes ADD COLUMN exec_defaults TEXT NOT NULL DEFAULT '{}';
    ALTER TABLE sandboxes ADD COLUMN delete_after_stop_seconds INTEGER;
    ALTER TABLE sandboxes ADD COLUMN stopped_at TEXT;
    CREATE INDEX sandboxes_name ON sandboxes (tenant, name);
    CREATE TABLE snapshot_tags (
        tenant TEXT NOT NULL,
        name TEXT NOT NULL,
        tag TEXT NOT NULL,
        snapshot_id TEXT NOT NULL,
        updated_at TEXT NOT NULL,
        PRIMARY KEY (tenant, name, tag)
    );
    """,
    """
    ALTER TABLE api_keys ADD COLUMN read_only INTEGER NOT NULL DEFAULT 0;
    CREATE TABLE key_uses (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        key_id TEXT NOT NULL,
        tenant TEXT NOT NULL,
        at TEXT NOT NULL,
        method TEXT NOT NULL,
        path TEXT NOT NULL,
        status INTEGER NOT NULL,
        client TEXT
    );
    CREATE INDEX key_uses_key ON key_uses (key_id, id);
    """,
    """
    CREATE TABLE eval_runs (
        id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        name TEXT,
        snapshot_id TEXT NOT NULL,
        tasks INTEGER NOT NULL,
        created_at TEXT NOT NULL,
        finished_at TEXT
    );
    CREATE INDEX eval_runs_tenant ON eval_runs (tenant, created_at);
    CREATE TABLE eval_results (
        run_id TEXT NOT NULL,
        task_id TEXT NOT NULL,
        sandbox_id TEXT,
        passed INTEGER NOT NULL,
        error TEXT,
        result TEXT NOT NULL,
        recorded_at TEXT NOT NULL,
        PRIMARY KEY (run_id, task_id)
    );
    CREATE INDEX eval_results_sandbox ON eval_results (sandbox_id);
    """,
    """
    CREATE TABLE ended_sessions (
        nonce TEXT PRIMARY KEY,
        expires INTEGER NOT NULL
    );
    """,
    """
    CREATE TABLE registries (
        id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        name TEXT NOT NULL,
        url TEXT NOT NULL,
        username TEXT,
        value TEXT,
        created_at TEXT NOT NULL,
        updated_at TEXT NOT NULL,
        UNIQUE (tenant, name)
    );
    """,
    """
    ALTER TABLE sandboxes ADD COLUMN stop_keeps_memory INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE snapshots ADD COLUMN memory INTEGER NOT NULL DEFAULT 1;
    ALTER TABLE sandboxes ADD COLUMN delegation TEXT;
    """,
    """
    ALTER TABLE sandboxes ADD COLUMN mounts TEXT NOT NULL DEFAULT '[]';
    """,
    # a secret's version (one more at each replacement) and its owner's metadata
    """
    ALTER TABLE secrets ADD COLUMN version INTEGER NOT NULL DEFAULT 1;
    ALTER TABLE secrets ADD COLUMN metadata TEXT NOT NULL DEFAULT '{}';
    """,
    """
    ALTER TABLE sandboxes ADD COLUMN bucket_mounts TEXT NOT NULL DEFAULT '[]';
    ALTER TABLE sandboxes ADD COLUMN mount_states TEXT NOT NULL DEFAULT '{}';
    """,
    # who may use a sandbox: keys get a principal and roles (every key made before is its
    # tenant's owner, so it keeps seeing and driving every sandbox); sandboxes record their
    # creator, and those made before are the tenant's (visibility `tenant`)
    """
    ALTER TABLE api_keys ADD COLUMN principal TEXT;
    ALTER TABLE api_keys ADD COLUMN roles TEXT NOT NULL DEFAULT '["owner"]';
    UPDATE api_keys SET roles = '["owner", "viewer"]' WHERE read_only = 1;
    ALTER TABLE sandboxes ADD COLUMN creator_key TEXT;
    ALTER TABLE sandboxes ADD COLUMN creator TEXT;
    ALTER TABLE sandboxes ADD COLUMN visibility TEXT NOT NULL DEFAULT 'tenant';
    ALTER TABLE sandboxes ADD COLUMN shares TEXT NOT NULL DEFAULT '{}';
    """,
    # metrics sampled over time (a bounded history per sandbox), lifecycle webhooks (their
    # secrets sealed) and their deliveries, in order per webhook and sandbox
    """
    CREATE TABLE sandbox_metrics (
        sandbox_id TEXT NOT NULL,
        at REAL NOT NULL,
        cpu_count INTEGER NOT NULL,
        cpu_used_pct REAL NOT NULL,
        mem_used INTEGER NOT NULL,
        mem_total INTEGER NOT NULL,
        mem_cache INTEGER NOT NULL,
        disk_used INTEGER NOT NULL,
        disk_total INTEGER NOT NULL
    );
    CREATE INDEX sandbox_metrics_at ON sandbox_metrics (sandbox_id, at);
    CREATE TABLE webhooks (
        id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        name TEXT NOT NULL,
        url TEXT NOT NULL,
        events TEXT NOT NULL,
        enabled INTEGER NOT NULL DEFAULT 1,
        flavor TEXT NOT NULL DEFAULT 'cella',
        value TEXT NOT NULL,
        created_at TEXT NOT NULL,
        updated_at TEXT NOT NULL
    );
    CREATE INDEX webhooks_tenant ON webhooks (tenant);
    CREATE TABLE webhook_deliveries (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        webhook_id TEXT NOT NULL,
        tenant TEXT NOT NULL,
        sandbox_id TEXT NOT NULL,
        event TEXT NOT NULL,
        body TEXT NOT NULL,
        state TEXT NOT NULL,
        attempts TEXT NOT NULL DEFAULT '[]',
        next_at REAL NOT NULL,
        created_at TEXT NOT NULL,
        delivered_at TEXT
    );
    CREATE INDEX webhook_deliveries_due ON webhook_deliveries (state, next_at);
    CREATE INDEX webhook_deliveries_hook ON webhook_deliveries (webhook_id, id);
    """,
    # volumes: a tenant's persistent file trees (their files are on the host, under the data
    # directory); sandboxes record the volumes they mount
    """
    CREATE TABLE volumes (
        id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        name TEXT NOT NULL,
        created_at TEXT NOT NULL,
        UNIQUE (tenant, name)
    );
    ALTER TABLE sandboxes ADD COLUMN volume_mounts TEXT NOT NULL DEFAULT '[]';
    """,
    # templates built from steps (E2B's `Template`): a tenant's names, their builds, tags
    """
    CREATE TABLE named_templates (
        id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        name TEXT NOT NULL,
        created_at TEXT NOT NULL,
        updated_at TEXT NOT NULL,
        UNIQUE (tenant, name)
    );
    CREATE TABLE template_builds (
        id TEXT PRIMARY KEY,
        template_id TEXT NOT NULL,
        tenant TEXT NOT NULL,
        state TEXT NOT NULL,
        spec TEXT NOT NULL,
        image TEXT,
        error TEXT,
        step TEXT,
        logs TEXT NOT NULL DEFAULT '[]',
        created_at TEXT NOT NULL,
        updated_at TEXT NOT NULL
    );
    CREATE INDEX template_builds_template ON template_builds (template_id);
    CREATE TABLE template_tags (
        template_id TEXT NOT NULL,
        tag TEXT NOT NULL,
        build_id TEXT NOT NULL,
        created_at TEXT NOT NULL,
        PRIMARY KEY (template_id, tag)
    );
    """,
    # a lifetime that time paused or stopped does not consume (`ttl_clock` running: the
    # time held so far, and since when it is held), and waking on traffic (`auto_resume`,
    # with the lifetime a wake grants when the old one has run out)
    """
    ALTER TABLE sandboxes ADD COLUMN ttl_clock TEXT NOT NULL DEFAULT 'wall';
    ALTER TABLE sandboxes ADD COLUMN held_seconds REAL NOT NULL DEFAULT 0;
    ALTER TABLE sandboxes ADD COLUMN held_since TEXT;
    ALTER TABLE sandboxes ADD COLUMN auto_resume INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE sandboxes ADD COLUMN wake_ttl_seconds INTEGER;
    """,
    # who set a sandbox's rewrite rules (their setter's principal, JSON), re-checked on every
    # rewritten request; NULL for rules set before: their setter is taken to be the
    # sandbox's creator key (or, with none, the tenant), as `service.rewrites` says
    """
    ALTER TABLE sandboxes ADD COLUMN rewrite_setter TEXT;
    """,
    # checkpoints: snapshots kept with their sandbox under a name of its own, and sandboxes
    # that take one after every command
    """
    ALTER TABLE snapshots ADD COLUMN checkpoint TEXT;
    ALTER TABLE sandboxes ADD COLUMN checkpoint_each_exec INTEGER NOT NULL DEFAULT 0;
    CREATE INDEX snapshots_checkpoints ON snapshots (sandbox_id, checkpoint);
    """,
    # Idempotency-Key: a create, fork or snapshot's key per tenant and route, the hash of
    # its body, and what it made (NULL while it runs); kept a day
    """
    CREATE TABLE idempotency_keys (
        tenant TEXT NOT NULL,
        route TEXT NOT NULL,
        key TEXT NOT NULL,
        body_hash TEXT NOT NULL,
        result TEXT,
        created_at REAL NOT NULL,
        PRIMARY KEY (tenant, route, key)
    );
    CREATE INDEX idempotency_keys_created ON idempotency_keys (created_at);
    """,
    # the exec policy (JSON), NULL: none
    """
    ALTER TABLE sandboxes ADD COLUMN exec_policy TEXT;
    """,
    # which process claimed an Idempotency-Key (gateways sharing a database: one retried
    # on another waits for the first while that one lives); NULL: this daemon
    """
    ALTER TABLE idempotency_keys ADD COLUMN owner TEXT;
    """,
]
