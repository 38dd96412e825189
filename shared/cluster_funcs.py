"""The only ways a node changes the cluster database: SQL functions, and who may call them.

Pure text (no I/O). ``tether cluster init`` (re)creates every function and privilege here each
time it runs, after the migrations, so a re-init repairs anything changed by hand.

Why functions. A node logs in as its own PostgreSQL role and may read the tables (all but a
job's ``env``) but write none of them: it may only call these functions, which run as the
tables' owner (``SECURITY DEFINER``) and learn which node is calling from ``session_user``
(``tether_me``), never from an argument. So PostgreSQL itself refuses a node that updates
another node's attempt, declares a live node down, rewrites a job or claims for someone else;
each invariant (a claim, a result for the current attempt, a node declared down with its jobs
moved) is one statement. A login that is neither a node (member of the node group) nor the
owner can read or call nothing (``PUBLIC`` is revoked everywhere).

What a node still vouches for: the user a request comes from. The agent read it from the
kernel (``SO_PEERCRED``) and passes the uid; the functions check ownership against it (cancel,
hold) and refuse root's jobs unless ``allow_root_jobs``. A compromised node can therefore act
as any non-root user in those requests (as root on a login node can ``su`` to anyone); every
such request records the node that vouched for it (``submit_node``, ``cancelled_by``).

Errors the functions raise carry SQLSTATEs of a class of our own (``TT``), mapped back to
tether's error codes by ``cluster_db.call``: TT400 bad request, TT403 permission denied,
TT404 not found, TT409 state, TT413 resources, TT503 the node is not up.

Every function sets ``search_path`` to ``pg_catalog``, the tables' schema and ``pg_temp`` last;
``init`` refuses a schema where ``PUBLIC`` may create objects (a function of someone else's
could then stand in for one of ours).
"""

from __future__ import annotations

from tether.shared import cluster_sched
from tether.shared.jobstates import (
    ACTIVE,
    FINAL,
    MOVES,
    PENDING,
    RESULTS,
    Move,
    sources,
    sql_list,
)

#: SQLSTATE -> tether error code
ERROR_CODES = {"TT400": "bad_request", "TT403": "permission_denied", "TT404": "not_found",
               "TT409": "state", "TT413": "resources", "TT429": "busy", "TT503": "not_up"}

#: what one node may ask of another's step, for the users it authenticated (cluster_relay.py):
#: the supervisor's verbs of inspect, attach and signal, and the agent's suspend and resume
ASK_KINDS = ("hello", "state", "info", "pids", "stats", "pmi", "output", "events", "signal",
             "suspend", "resume")
#: asks one node may have waiting at once
MAX_ASKS = 64

#: (name, argument types) of every function, and whether nodes may call it
NODE_FUNCTIONS = (
    ("tether_register", "text, text, text, integer, integer, bigint, text, text, boolean"),
    ("tether_heartbeat", "text"),
    ("tether_mark_up", "text"),
    ("tether_leave_if_idle", "text"),
    ("tether_reap", ""),
    ("tether_claim", "text, integer, integer, bigint"),
    ("tether_set_running", "bigint, integer, bigint, text, jsonb, jsonb, jsonb, integer"),
    ("tether_report", "bigint, integer, jsonb"),
    ("tether_requeue_unknown", "bigint, integer, text"),
    ("tether_submit", "jsonb"),
    ("tether_set_outputs", "jsonb"),
    ("tether_cancel", "bigint, integer"),
    ("tether_hold", "bigint, integer, boolean"),
    ("tether_set_drain", "text, boolean, integer"),
    ("tether_ask", "bigint, integer, text, jsonb"),
    ("tether_asked", ""),
    ("tether_answer", "bigint, jsonb"),
    ("tether_answer_of", "bigint"),
    ("tether_factors", ""),
)
#: helpers only the functions above call
INTERNAL_FUNCTIONS = (
    ("tether_me", ""),
    ("tether_setting", "text, text"),
    ("tether_now_text", ""),
    ("tether_invalid", "tether_jobs"),
    ("tether_lose", "bigint, integer, text"),
    ("tether_deps", "tether_jobs"),
    ("tether_charge", "bigint, integer"),
)
#: functions of earlier versions, dropped at ``init``
OBSOLETE_FUNCTIONS = (("tether_deps", "jsonb"),)

_DEF = "LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, {schema}, pg_temp"

FUNCTIONS = """
CREATE OR REPLACE FUNCTION tether_now_text() RETURNS text LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp AS $$
  SELECT to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"')
$$;

CREATE OR REPLACE FUNCTION tether_setting(k text, dflt text) RETURNS text LANGUAGE sql STABLE
SECURITY DEFINER SET search_path = pg_catalog, {schema}, pg_temp AS $$
  SELECT coalesce((SELECT value FROM tether_meta WHERE key = k), dflt)
$$;

-- The node the calling login is, from the role it logged in as; nothing it says counts.
CREATE OR REPLACE FUNCTION tether_me() RETURNS text STABLE {definer} AS $$
DECLARE n text;
BEGIN
  SELECT name INTO n FROM tether_nodes WHERE role = session_user::text;
  IF n IS NULL THEN
    RAISE EXCEPTION 'database role % is no tether node (an administrator runs `tether cluster '
      'add-node NAME`)', session_user USING ERRCODE = 'TT403';
  END IF;
  RETURN n;
END $$;

-- Why a job row cannot run, or NULL. Rows may come from anywhere (the owner's SQL, an older
-- tether): a bad one is failed with this reason by the first node that meets it.
CREATE OR REPLACE FUNCTION tether_invalid(j tether_jobs) RETURNS text {definer} AS $$
BEGIN
  IF jsonb_typeof(j.command) IS DISTINCT FROM 'array' OR jsonb_array_length(j.command) = 0
     OR EXISTS (SELECT 1 FROM jsonb_array_elements(j.command) e
                WHERE jsonb_typeof(e) <> 'string')
     OR coalesce(j.command->>0, '') = '' THEN
    RETURN 'command must be a non-empty array of strings';
  END IF;
  IF octet_length(j.command::text) > 262144 THEN
    RETURN 'the command line is too long';
  END IF;
  IF jsonb_typeof(j.env) IS DISTINCT FROM 'object'
     OR EXISTS (SELECT 1 FROM jsonb_each(j.env) e
                WHERE jsonb_typeof(e.value) <> 'string' OR e.key = '' OR strpos(e.key, '=') > 0)
  THEN
    RETURN 'env must map variable names to string values';
  END IF;
  IF j.cpus_per_task IS NULL OR j.cpus_per_task < 1 OR j.ntasks IS NULL OR j.ntasks < 1
     OR j.ntasks > 1024 OR j.gpus_req IS NULL OR j.gpus_req < 0 OR j.memory_mb IS NULL
     OR j.memory_mb < 0 THEN
    RETURN 'cpus_per_task and ntasks must be at least 1 (ntasks at most 1024), gpus and '
      'memory not negative';
  END IF;
  IF j.pmi IS NULL OR j.pmi NOT IN ('none', 'pmi1', 'pmi2') THEN
    RETURN format('unknown PMI %L', j.pmi);
  END IF;
  IF j.uid IS NULL OR j.uid < 0 OR j.gid IS NULL OR j.gid < 0 OR coalesce(j.username, '') = ''
  THEN
    RETURN 'the job names no user (uid, gid, user name)';
  END IF;
  IF left(j.workdir, 1) <> '/' OR left(j.output, 1) <> '/' OR left(j.error, 1) <> '/' THEN
    RETURN 'workdir, output and error must be absolute paths';
  END IF;
  IF coalesce(j.submitted_at, '') = '' THEN
    RETURN 'no submission time';
  END IF;
  IF octet_length(j.script) > 524288 THEN
    RETURN 'the batch script is over 512 KiB';
  END IF;
  IF j.umask IS NULL OR j.umask < 0 OR j.umask > 511 THEN
    RETURN 'umask must be 0 to 0777';
  END IF;
  IF (j.time_limit IS NOT NULL AND NOT j.time_limit > 0) OR jsonb_typeof(j.dependency)
     IS DISTINCT FROM 'array' OR (j.array_max IS NOT NULL AND j.array_max < 1) THEN
    RETURN 'time_limit must be positive, dependency a list, array_max at least 1';
  END IF;
  RETURN NULL;
END $$;

-- ---- membership -------------------------------------------------------------------------

-- Join or rejoin as the calling node: 'new' (never joined), 'down' (declared down meanwhile) or
-- 'up'. A node that was not up stays down until tether_mark_up, after its agent reconciled.
CREATE OR REPLACE FUNCTION tether_register(p_name text, p_host text, p_state_dir text,
    p_cpus integer, p_gpus integer, p_memory_mb bigint, p_version text, p_session text,
    p_login boolean) RETURNS text {definer} AS $$
DECLARE
  me text := tether_me();
  r record;
  timeout float8 := tether_setting('heartbeat_timeout', '30')::float8;
BEGIN
  IF p_name IS DISTINCT FROM me THEN
    RAISE EXCEPTION 'this database login is node %, not %: give the agent --node %', me,
      p_name, me USING ERRCODE = 'TT403';
  END IF;
  SELECT state, host, state_dir, session,
         extract(epoch FROM clock_timestamp() - heartbeat)::float8 AS age
    INTO r FROM tether_nodes WHERE name = me FOR UPDATE;
  IF r.state = 'up' AND r.age < timeout AND r.session <> ''
     AND (r.host, r.state_dir) IS DISTINCT FROM (p_host, p_state_dir) THEN
    RAISE EXCEPTION 'node % is up with another agent (host %, state dir %, heartbeat %s ago): '
      'pick another --node', me, r.host, r.state_dir, round(r.age::numeric, 1)
      USING ERRCODE = 'TT409';
  END IF;
  UPDATE tether_nodes SET host = p_host, state_dir = p_state_dir, cpus = p_cpus,
         gpus = p_gpus, memory_mb = p_memory_mb, version = p_version, session = p_session,
         login = p_login, heartbeat = clock_timestamp(), registered_at = clock_timestamp()
   WHERE name = me;
  RETURN CASE WHEN r.session = '' THEN 'new' ELSE r.state END;
END $$;

CREATE OR REPLACE FUNCTION tether_mark_up(p_session text) RETURNS void {definer} AS $$
BEGIN
  UPDATE tether_nodes SET state = 'up', reason = NULL, heartbeat = clock_timestamp()
   WHERE name = tether_me() AND session = p_session;
  PERFORM pg_notify('tether_queue', '');
END $$;

-- 'up', 'draining', 'down' (declared down meanwhile) or 'taken' (another agent registered
-- this node since).
CREATE OR REPLACE FUNCTION tether_heartbeat(p_session text) RETURNS text {definer} AS $$
DECLARE me text := tether_me(); d boolean; s text;
BEGIN
  UPDATE tether_nodes SET heartbeat = clock_timestamp()
   WHERE name = me AND session = p_session AND state = 'up' RETURNING drain INTO d;
  IF FOUND THEN
    RETURN CASE WHEN d THEN 'draining' ELSE 'up' END;
  END IF;
  SELECT session INTO s FROM tether_nodes WHERE name = me;
  RETURN CASE WHEN s IS DISTINCT FROM p_session THEN 'taken' ELSE 'down' END;
END $$;

CREATE OR REPLACE FUNCTION tether_leave_if_idle(p_session text) RETURNS boolean {definer} AS $$
DECLARE me text := tether_me();
BEGIN
  UPDATE tether_nodes SET state = 'down', reason = 'its agent stopped while idle'
   WHERE name = me AND session = p_session AND NOT EXISTS (
     SELECT 1 FROM tether_jobs WHERE node = me AND state IN {active});
  RETURN FOUND;
END $$;

-- Declare down every up node whose heartbeat is older than the timeout plus the fencing margin,
-- by the database's clock: by then that node's own steps have killed their tasks (their lease
-- ran out at the timeout, shared/lease.py), so its jobs may run elsewhere without overlapping.
-- Only a node that is up and beat on time itself may judge, and not before the server has run
-- for as long (after a restart every heartbeat looks stale). Each node's active jobs go back to
-- the queue (attempt + 1 at their next claim), or end node_fail (--no-requeue), or cancelled
-- if that was asked; their attempts are lost.
CREATE OR REPLACE FUNCTION tether_reap() RETURNS jsonb {definer} AS $$
DECLARE
  me text := tether_me();
  timeout float8 := tether_setting('heartbeat_timeout', '30')::float8;
  margin float8 := tether_setting('fence_margin', '5')::float8;
  mine record; n record; j record;
  why text; v_state text; v_reason text;
  requeued bigint[]; failed bigint[];
  done jsonb := '[]';
BEGIN
  SELECT state, extract(epoch FROM clock_timestamp() - heartbeat)::float8 AS age INTO mine
    FROM tether_nodes WHERE name = me;
  IF mine.state <> 'up' OR mine.age > timeout
     OR extract(epoch FROM clock_timestamp() - pg_postmaster_start_time()) < timeout + margin
  THEN
    RETURN done;
  END IF;
  FOR n IN SELECT name, extract(epoch FROM clock_timestamp() - heartbeat)::float8 AS age
             FROM tether_nodes
            WHERE state = 'up' AND name <> me
              AND heartbeat < clock_timestamp() - make_interval(secs => timeout + margin)
            ORDER BY name FOR UPDATE SKIP LOCKED LOOP
    why := format('node %s missed its heartbeats (last %ss ago; timeout %ss, after which its '
                  'steps fence themselves, and a margin of %ss); declared down by %s', n.name,
                  round(n.age::numeric, 1), timeout, margin, me);
    UPDATE tether_nodes SET state = 'down', reason = why WHERE name = n.name;
    requeued := '{{}}'; failed := '{{}}';
    FOR j IN SELECT id, attempt, requeue, cancel_requested FROM tether_jobs
              WHERE node = n.name AND state IN {lose_from} FOR UPDATE LOOP
      SELECT * INTO v_state, v_reason FROM tether_lose(j.id, j.attempt, why);
      IF v_state = 'pending' THEN
        requeued := requeued || j.id;
      ELSE
        failed := failed || j.id;
      END IF;
    END LOOP;
    done := done || jsonb_build_object('node', n.name, 'requeued', to_jsonb(requeued),
                                       'failed', to_jsonb(failed), 'reason', why);
  END LOOP;
  RETURN done;
END $$;

-- The current attempt of a job was lost with its node (declared down, or its step fenced
-- itself): the job goes back to the queue, or ends node_fail (--no-requeue), or cancelled if
-- that was asked. The caller holds the job's row. Returns the new state and reason.
CREATE OR REPLACE FUNCTION tether_lose(p_job bigint, p_attempt integer, p_why text,
    OUT v_state text, OUT v_reason text) {definer} AS $$
DECLARE j record;
BEGIN
  SELECT requeue, cancel_requested INTO j FROM tether_jobs WHERE id = p_job;
  IF j.cancel_requested THEN
    v_state := 'cancelled'; v_reason := 'cancelled; ' || p_why;
  ELSIF j.requeue THEN
    v_state := 'pending';
    v_reason := format('requeued after attempt %s: %s', p_attempt, p_why);
  ELSE
    v_state := {lose_to}; v_reason := p_why || '; not requeued (--no-requeue)';
  END IF;
  IF v_state = 'pending' THEN
    UPDATE tether_jobs SET state = v_state, reason = v_reason, node = NULL, ended_at = NULL
     WHERE id = p_job;
    PERFORM pg_notify('tether_queue', '');
  ELSE
    UPDATE tether_jobs SET state = v_state, reason = v_reason, ended_at = tether_now_text()
     WHERE id = p_job;
  END IF;
  PERFORM tether_charge(p_job, p_attempt);  -- what it held until lost
  UPDATE tether_attempts SET state = 'lost', reason = p_why, ended_at = clock_timestamp()
   WHERE job = p_job AND attempt = p_attempt;
  PERFORM pg_notify('tether_job', p_job::text);
END $$;

-- ---- work -------------------------------------------------------------------------------

-- tether_claim: the scheduler, shared/cluster_sched.py

CREATE OR REPLACE FUNCTION tether_set_running(p_job bigint, p_attempt integer,
    p_local_job bigint, p_started_at text, p_cpus jsonb, p_gpus jsonb, p_pids jsonb,
    p_supervisor_pid integer) RETURNS boolean {definer} AS $$
DECLARE me text := tether_me();
BEGIN
  UPDATE tether_jobs SET state = {start_to}, local_job = p_local_job,
         started_at = p_started_at, cpus = p_cpus, gpus = p_gpus, pids = p_pids,
         supervisor_pid = p_supervisor_pid
   WHERE id = p_job AND attempt = p_attempt AND node = me AND state IN {start_from};
  IF NOT FOUND THEN
    RETURN false;
  END IF;
  UPDATE tether_attempts SET state = 'running'
   WHERE job = p_job AND attempt = p_attempt AND state = 'starting';
  RETURN true;
END $$;

-- Record the final result of (job, attempt): NULL if recorded, else why it was refused (the
-- attempt is no longer the caller's current one).
CREATE OR REPLACE FUNCTION tether_report(p_job bigint, p_attempt integer, p_result jsonb)
    RETURNS text {definer} AS $$
DECLARE me text := tether_me(); r record; st text := p_result->>'state';
BEGIN
  IF st IS NULL OR st NOT IN {results} THEN
    RAISE EXCEPTION 'a result''s state must be a final one, not %', st USING ERRCODE = 'TT400';
  END IF;
  SELECT state, attempt, node INTO r FROM tether_jobs WHERE id = p_job FOR UPDATE;
  IF NOT FOUND THEN
    RETURN format('job %s is not in the cluster', p_job);
  END IF;
  IF r.attempt <> p_attempt OR r.node IS DISTINCT FROM me
     OR r.state NOT IN {end_from} THEN
    RETURN format('job %s attempt %s is no longer current here (now attempt %s, %s, node %s)',
                  p_job, p_attempt, r.attempt, r.state, r.node);
  END IF;
  IF coalesce((p_result->>'never_ran')::boolean, false) THEN
    -- this node could not start it (its supervisor never started): it never ran, so it goes
    -- back to the queue whatever --no-requeue says, for another node
    PERFORM tether_requeue_unknown(p_job, p_attempt, format('node %s could not start it: %s',
                                                            me, p_result->>'reason'));
    RETURN NULL;
  END IF;
  IF coalesce((p_result->>'fenced')::boolean, false) THEN
    -- its step killed its tasks when the node's lease ran out: the node's loss, not the job's
    PERFORM tether_lose(p_job, p_attempt, p_result->>'reason');
    RETURN NULL;
  END IF;
  UPDATE tether_jobs SET state = st,
         exit_code = (p_result->>'exit_code')::integer,
         signal = (p_result->>'signal')::integer,
         reason = p_result->>'reason',
         started_at = coalesce(p_result->>'started_at', started_at),
         ended_at = coalesce(p_result->>'ended_at', tether_now_text()),
         pids = coalesce(p_result->'pids', pids),
         supervisor_pid = coalesce((p_result->>'supervisor_pid')::integer, supervisor_pid),
         cpus = coalesce(p_result->'cpus', cpus), gpus = coalesce(p_result->'gpus', gpus),
         local_job = coalesce((p_result->>'local_job')::bigint, local_job),
         usage = CASE WHEN jsonb_typeof(p_result->'usage') = 'object'
                      AND octet_length((p_result->'usage')::text) <= 4096
                      THEN p_result->'usage' END
   WHERE id = p_job;
  PERFORM tether_charge(p_job, p_attempt);  -- its user's usage (fair share)
  UPDATE tether_attempts SET state = st, reason = p_result->>'reason',
         ended_at = clock_timestamp() WHERE job = p_job AND attempt = p_attempt;
  PERFORM pg_notify('tether_job', p_job::text);
  PERFORM pg_notify('tether_queue', '');
  RETURN NULL;
END $$;

-- A claim of the caller's that it never recorded locally: it never ran, so it is queued again
-- (or ends cancelled if that was asked).
CREATE OR REPLACE FUNCTION tether_requeue_unknown(p_job bigint, p_attempt integer, p_why text)
    RETURNS boolean {definer} AS $$
DECLARE me text := tether_me(); hit boolean;
BEGIN
  UPDATE tether_jobs SET
         state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'pending' END,
         node = CASE WHEN cancel_requested THEN node ELSE NULL END, reason = p_why,
         ended_at = CASE WHEN cancel_requested THEN tether_now_text() END
   WHERE id = p_job AND attempt = p_attempt AND node = me AND state IN {requeue_from};
  hit := FOUND;
  IF hit THEN
    UPDATE tether_attempts SET state = 'lost', reason = p_why, ended_at = clock_timestamp()
     WHERE job = p_job AND attempt = p_attempt;
    PERFORM pg_notify('tether_queue', '');
    PERFORM pg_notify('tether_job', p_job::text);
  END IF;
  RETURN hit;
END $$;

-- ---- what people ask, through the agent that authenticated them ---------------------------

-- Queue a job for the user the calling node authenticated: one row, or one per index of an
-- array (p->'array': {{"indices": [...], "max": N}}; the first element's id is the array's). Its
-- dependencies (p->'dependency': [[kind, job, index or null], ...]) are resolved here: a job
-- (an element named by its index too) as [kind, id], an array's id as [kind, -id] (all its
-- elements together), singleton as ["singleton", 0]. Output and error keep their tokens: the
-- submitting agent writes them expanded (tether_set_outputs) in the same transaction. Returns
-- the ids, in index order.
CREATE OR REPLACE FUNCTION tether_submit(p jsonb) RETURNS bigint[] {definer} AS $$
DECLARE
  me text := tether_me();
  j tether_jobs;
  bad text;
  need bigint;
  ids bigint[] := '{{}}';
  deps jsonb := '[]';
  d jsonb;
  found bigint[];
  idx integer;
  first bigint;
  indices jsonb := coalesce(p->'array'->'indices', 'null');
BEGIN
  IF (p->>'uid')::integer = 0 AND tether_setting('allow_root_jobs', 'false') <> 'true' THEN
    RAISE EXCEPTION 'root jobs are disabled in this cluster (an administrator allows them with '
      '`tether cluster init --root-jobs allow`)' USING ERRCODE = 'TT403';
  END IF;
  FOR d IN SELECT * FROM jsonb_array_elements(coalesce(p->'dependency', '[]')) LOOP
    IF d->>0 = 'singleton' THEN
      deps := deps || jsonb_build_array(jsonb_build_array('singleton', 0));
      CONTINUE;
    END IF;
    IF d->>2 IS NULL THEN
      IF EXISTS (SELECT 1 FROM tether_jobs WHERE array_id = (d->>1)::bigint) THEN
        -- an array's id: all its elements together, as [kind, -id] (tether_deps)
        deps := deps || jsonb_build_array(jsonb_build_array(d->>0, -(d->>1)::bigint));
        CONTINUE;
      END IF;
      SELECT array_agg(id) INTO found FROM tether_jobs WHERE id = (d->>1)::bigint;
    ELSE
      SELECT array_agg(id) INTO found FROM tether_jobs
       WHERE array_id = (d->>1)::bigint AND array_index = (d->>2)::integer;
    END IF;
    IF found IS NULL THEN
      RAISE EXCEPTION 'dependency: no job %', d->>1 || coalesce('_' || (d->>2), '')
        USING ERRCODE = 'TT404';
    END IF;
    deps := deps || jsonb_build_array(jsonb_build_array(d->>0, found[1]));
  END LOOP;
  IF jsonb_array_length(deps) > 1000 THEN
    RAISE EXCEPTION 'dependency names more than 1000 jobs'
      USING ERRCODE = 'TT400';
  END IF;
  FOR idx IN SELECT CASE WHEN indices = 'null' THEN NULL ELSE e::integer END FROM
             (SELECT jsonb_array_elements_text(CASE WHEN indices = 'null' THEN '[null]'
                                                    ELSE indices END) e) x LOOP
    INSERT INTO tether_jobs (name, command, state, cpus_per_task, ntasks, gpus_req, memory_mb,
           output, error, workdir, env, submitted_at, pmi, username, uid, gid, groups, requeue,
           held, submit_node, umask, time_limit, begin_at, dependency, array_id, array_index,
           array_max, script, slurm_env)
    VALUES (p->>'name', p->'command', 'pending', (p->>'cpus_per_task')::integer,
            (p->>'ntasks')::integer, (p->>'gpus_req')::integer, (p->>'memory_mb')::bigint,
            coalesce(p->>'output', ''), coalesce(p->>'error', ''), p->>'workdir', p->'env',
            tether_now_text(), coalesce(p->>'pmi', 'none'), p->>'username',
            (p->>'uid')::integer, (p->>'gid')::integer, coalesce(p->'groups', '[]'),
            coalesce((p->>'requeue')::boolean, tether_setting('requeue', 'true')::boolean),
            coalesce((p->>'held')::boolean, false), me,
            coalesce((p->>'umask')::integer, 18), (p->>'time_limit')::float8,
            (p->>'begin_at')::float8, deps, first, idx, (p->'array'->>'max')::integer,
            decode(p->>'script', 'base64'), coalesce((p->>'slurm_env')::boolean, false))
    RETURNING * INTO j;
    IF idx IS NOT NULL AND first IS NULL THEN  -- the array's id is its first element's
      first := j.id;
      UPDATE tether_jobs SET array_id = first WHERE id = j.id RETURNING * INTO j;
    END IF;
    IF j.output = '' THEN
      UPDATE tether_jobs SET output = workdir || '/tether-%j.out' WHERE id = j.id
      RETURNING * INTO j;
    END IF;
    IF j.error = '' THEN
      UPDATE tether_jobs SET error = output WHERE id = j.id RETURNING * INTO j;
    END IF;
    bad := tether_invalid(j);
    IF bad IS NOT NULL THEN
      RAISE EXCEPTION '%', bad USING ERRCODE = 'TT400';
    END IF;
    ids := ids || j.id;
  END LOOP;
  need := j.cpus_per_task::bigint * j.ntasks;
  IF EXISTS (SELECT 1 FROM tether_nodes WHERE NOT login AND cpus > 0)
     AND NOT EXISTS (SELECT 1 FROM tether_nodes WHERE NOT login AND need <= cpus
                     AND j.gpus_req <= gpus AND j.memory_mb <= memory_mb) THEN
    RAISE EXCEPTION 'job can never run on any node of the cluster: it needs % CPUs, % GPUs and '
      '% MB of memory', need, j.gpus_req, j.memory_mb USING ERRCODE = 'TT413';
  END IF;
  PERFORM pg_notify('tether_queue', '');
  RETURN ids;
END $$;

-- The expanded output and error of jobs this node just submitted (in the same transaction):
-- p is [[id, output, error], ...].
CREATE OR REPLACE FUNCTION tether_set_outputs(p jsonb) RETURNS void {definer} AS $$
DECLARE me text := tether_me(); e jsonb;
BEGIN
  FOR e IN SELECT * FROM jsonb_array_elements(p) LOOP
    UPDATE tether_jobs SET output = e->>1, error = e->>2
     WHERE id = (e->>0)::bigint AND submit_node = me AND state = 'pending'
       AND left(e->>1, 1) = '/' AND left(e->>2, 1) = '/';
  END LOOP;
END $$;

-- Cancel for the user the calling node authenticated (the owner or root): a queued job ends
-- here; a running one is asked of its node, which stops it and reports the end.
CREATE OR REPLACE FUNCTION tether_cancel(p_job bigint, p_uid integer) RETURNS text
    {definer} AS $$
DECLARE me text := tether_me(); r record;
BEGIN
  SELECT state, uid, username INTO r FROM tether_jobs WHERE id = p_job FOR UPDATE;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'no job %', p_job USING ERRCODE = 'TT404';
  END IF;
  IF p_uid <> 0 AND p_uid IS DISTINCT FROM r.uid THEN
    RAISE EXCEPTION 'permission denied: ''cancel'' of job % is for its owner (%) and root only '
      '(you are uid %)', p_job, r.username, p_uid USING ERRCODE = 'TT403';
  END IF;
  IF r.state NOT IN {cancellable} THEN
    RAISE EXCEPTION 'job % has already ended (%)', p_job, r.state USING ERRCODE = 'TT409';
  END IF;
  IF r.state IN {cancel_from} THEN
    UPDATE tether_jobs SET state = {cancel_to}, reason = 'cancelled while pending',
           ended_at = tether_now_text(), cancelled_by = format('uid %s on node %s', p_uid, me)
     WHERE id = p_job;
  ELSE
    UPDATE tether_jobs SET cancel_requested = true,
           cancelled_by = format('uid %s on node %s', p_uid, me) WHERE id = p_job;
  END IF;
  PERFORM pg_notify('tether_job', p_job::text);
  RETURN CASE WHEN r.state IN {cancel_from} THEN {cancel_to} ELSE r.state END;
END $$;

CREATE OR REPLACE FUNCTION tether_hold(p_job bigint, p_uid integer, p_held boolean)
    RETURNS void {definer} AS $$
DECLARE r record;
BEGIN
  PERFORM tether_me();
  SELECT state, uid, username INTO r FROM tether_jobs WHERE id = p_job FOR UPDATE;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'no job %', p_job USING ERRCODE = 'TT404';
  END IF;
  IF p_uid <> 0 AND p_uid IS DISTINCT FROM r.uid THEN
    RAISE EXCEPTION 'permission denied: ''%'' of job % is for its owner (%) and root only '
      '(you are uid %)', CASE WHEN p_held THEN 'hold' ELSE 'release' END, p_job, r.username,
      p_uid USING ERRCODE = 'TT403';
  END IF;
  IF r.state NOT IN {hold_from} THEN
    RAISE EXCEPTION 'job % is %: only a pending job can be %', p_job, r.state,
      CASE WHEN p_held THEN 'held' ELSE 'released' END USING ERRCODE = 'TT409';
  END IF;
  UPDATE tether_jobs SET held = p_held WHERE id = p_job;
  IF NOT p_held THEN
    PERFORM pg_notify('tether_queue', '');
  END IF;
  PERFORM pg_notify('tether_job', p_job::text);
END $$;

-- ---- one node asking another's step, for a user it authenticated (cluster_relay.py) ------

-- Ask the node that runs job p_job to put a request to its step (its supervisor, or its agent
-- for suspend and resume), for user p_uid (the owner or root). Returns the ask's id; the
-- answer comes with NOTIFY tether_answer and is read once with tether_answer_of.
CREATE OR REPLACE FUNCTION tether_ask(p_job bigint, p_uid integer, p_kind text, p_args jsonb)
    RETURNS bigint {definer} AS $$
DECLARE me text := tether_me(); r record; v_id bigint;
BEGIN
  SELECT node, local_job, uid, username, state INTO r FROM tether_jobs WHERE id = p_job;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'no job %', p_job USING ERRCODE = 'TT404';
  END IF;
  IF p_uid <> 0 AND p_uid IS DISTINCT FROM r.uid THEN
    RAISE EXCEPTION 'permission denied: job % is its owner''s (%) and root''s to look into or '
      'signal (you are uid %)', p_job, r.username, p_uid USING ERRCODE = 'TT403';
  END IF;
  IF r.node IS NULL OR r.local_job IS NULL THEN
    RAISE EXCEPTION 'job % is %: it runs on no node', p_job, r.state USING ERRCODE = 'TT409';
  END IF;
  IF p_kind NOT IN {ask_kinds} OR jsonb_typeof(p_args) IS DISTINCT FROM 'object'
     OR octet_length(p_args::text) > 4096 THEN
    RAISE EXCEPTION 'a node may not ask %', p_kind USING ERRCODE = 'TT400';
  END IF;
  DELETE FROM tether_asks WHERE asked_at < clock_timestamp() - interval '10 minutes';
  IF (SELECT count(*) FROM tether_asks WHERE from_node = me) >= {max_asks} THEN
    RAISE EXCEPTION 'node % has {max_asks} asks of other nodes waiting already: try again', me
      USING ERRCODE = 'TT429';
  END IF;
  INSERT INTO tether_asks (from_node, to_node, job, local_job, uid, kind, args)
  VALUES (me, r.node, p_job, r.local_job, p_uid, p_kind, p_args) RETURNING id INTO v_id;
  PERFORM pg_notify('tether_ask', r.node);
  RETURN v_id;
END $$;

-- The asks waiting for the calling node, taken (each is served once).
CREATE OR REPLACE FUNCTION tether_asked() RETURNS SETOF jsonb {definer} AS $$
DECLARE me text := tether_me();
BEGIN
  RETURN QUERY UPDATE tether_asks SET taken = true WHERE id IN (
      SELECT id FROM tether_asks WHERE to_node = me AND NOT taken ORDER BY id LIMIT 16
      FOR UPDATE SKIP LOCKED)
    RETURNING jsonb_build_object('id', id, 'job', job, 'local_job', local_job, 'uid', uid,
                                 'kind', kind, 'args', args, 'from', from_node);
END $$;

CREATE OR REPLACE FUNCTION tether_answer(p_id bigint, p_answer jsonb) RETURNS void
    {definer} AS $$
BEGIN
  UPDATE tether_asks SET answer = p_answer WHERE id = p_id AND to_node = tether_me()
     AND octet_length(p_answer::text) <= 2097152;
  PERFORM pg_notify('tether_answer', p_id::text);
END $$;

-- The answer to one of the calling node's asks, once (the ask is gone after); NULL while
-- there is none. p_forget: give up on it.
CREATE OR REPLACE FUNCTION tether_answer_of(p_id bigint) RETURNS jsonb {definer} AS $$
DECLARE a jsonb;
BEGIN
  DELETE FROM tether_asks WHERE id = p_id AND from_node = tether_me() AND answer IS NOT NULL
  RETURNING answer INTO a;
  RETURN a;
END $$;

CREATE OR REPLACE FUNCTION tether_set_drain(p_node text, p_drain boolean, p_uid integer)
    RETURNS void {definer} AS $$
BEGIN
  PERFORM tether_me();
  IF p_uid <> 0 THEN
    RAISE EXCEPTION 'permission denied: draining and resuming nodes is for root only (you are '
      'uid %)', p_uid USING ERRCODE = 'TT403';
  END IF;
  UPDATE tether_nodes SET drain = p_drain WHERE name = p_node;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'no node % in the cluster', quote_literal(p_node) USING ERRCODE = 'TT404';
  END IF;
  IF NOT p_drain THEN
    PERFORM pg_notify('tether_queue', '');
  END IF;
END $$;
"""

#: Columns of ``tether_jobs`` nodes may read: all but ``env``.
READABLE_JOB_COLUMNS = (
    "id, name, command, state, attempt, node, local_job, exit_code, signal, reason, "
    "cpus_per_task, ntasks, gpus_req, memory_mb, cpus, gpus, supervisor_pid, pids, output, "
    "error, workdir, submitted_at, started_at, ended_at, cancel_requested, requeue, pmi, "
    "username, uid, gid, submit_node, groups, held, cancelled_by, umask, time_limit, begin_at, "
    "dependency, array_id, array_index, array_max, usage, slurm_env, pending_reason"
)

TABLES = ("tether_meta", "tether_nodes", "tether_jobs", "tether_attempts", "tether_asks",
          "tether_usage")


def state_words() -> dict[str, str]:
    """The states each function's guards name, from the one table (shared/jobstates.py)."""
    def to(move: Move) -> str:
        target = MOVES[move][1]
        assert target is not None
        return f"'{target}'"
    return {
        "active": sql_list(ACTIVE), "results": sql_list(RESULTS), "final": sql_list(FINAL),
        "unsuccessful": sql_list(tuple(s for s in FINAL if s != "completed")),
        "unfinished": sql_list((PENDING, *ACTIVE)),
        "claim_from": sql_list(sources(Move.CLAIM)), "claim_to": to(Move.CLAIM),
        "start_from": sql_list(sources(Move.START)), "start_to": to(Move.START),
        "end_from": sql_list(sources(Move.END)),
        "requeue_from": sql_list(sources(Move.REQUEUE)),
        "lose_from": sql_list(sources(Move.LOSE)), "lose_to": to(Move.LOSE),
        "cancel_from": sql_list(sources(Move.CANCEL)), "cancel_to": to(Move.CANCEL),
        "cancellable": sql_list(sources(Move.CANCEL) + sources(Move.ASK_CANCEL)),
        "never_to": to(Move.NEVER), "invalid_to": to(Move.INVALID),
        "hold_from": sql_list(sources(Move.HOLD)),
    }


def functions_sql(schema_ident: str) -> str:
    """The functions' text for tables in the schema ``schema_ident`` (already quoted): each
    dropped first, so that a function whose result type changed is made anew."""
    drops = "".join(f"DROP FUNCTION IF EXISTS {name}({args});\n"
                    for name, args in NODE_FUNCTIONS + INTERNAL_FUNCTIONS + OBSOLETE_FUNCTIONS)
    kinds = "(" + ", ".join(f"'{k}'" for k in ASK_KINDS) + ")"
    words = dict(schema=schema_ident, definer=_DEF.format(schema=schema_ident),
                 ask_kinds=kinds, max_asks=MAX_ASKS, claim_lock=cluster_sched.CLAIM_LOCK,
                 window=cluster_sched.WINDOW, half_life=cluster_sched.DEFAULT_HALF_LIFE,
                 **state_words())
    return (drops + FUNCTIONS.format(**words)
            + cluster_sched.SCHED_FUNCTIONS.format(**words))


def privileges_sql(group_ident: str) -> list[str]:
    """Statements that leave PUBLIC nothing and the node group reads and calls only."""
    out = [f"REVOKE ALL ON {', '.join(TABLES)} FROM PUBLIC, {group_ident}",
           f"REVOKE ALL ON SEQUENCE tether_jobs_id_seq, tether_asks_id_seq FROM PUBLIC, "
           f"{group_ident}",
           f"GRANT SELECT ON tether_meta, tether_nodes, tether_attempts, tether_usage TO "
           f"{group_ident}",
           f"GRANT SELECT ({READABLE_JOB_COLUMNS}) ON tether_jobs TO {group_ident}"]
    for name, args in INTERNAL_FUNCTIONS + NODE_FUNCTIONS:
        out.append(f"REVOKE ALL ON FUNCTION {name}({args}) FROM PUBLIC, {group_ident}")
    for name, args in NODE_FUNCTIONS:
        out.append(f"GRANT EXECUTE ON FUNCTION {name}({args}) TO {group_ident}")
    return out
