"""The cluster's scheduler, in the database: one node's rules across every node. Pure text.

A single node's scheduler (``agent/schedule.py``, ``agent/fairshare.py``) orders its queue by
fair share and starts jobs by EASY backfill; ``tether_claim`` does the same for the cluster,
in one call of a ``SECURITY DEFINER`` function by the node that claims, so the plan and the
claims it makes are one transaction:

- **One plan at a time.** A claim takes a transaction-scoped advisory lock (``CLAIM_LOCK``)
  first: claims of different nodes run one after the other, each seeing the committed claims
  of the one before (every statement of a volatile PL/pgSQL function takes a fresh snapshot
  under READ COMMITTED), so two nodes never plan the same CPUs or pass over the same
  reservation. A claim is short (a window of at most ``WINDOW`` pending jobs).
- **Order.** Pending jobs are taken by their user's fair-share factor (``tether_factors``:
  Slurm's classic ``2 ** (-usage_norm / shares_norm)``, equal shares, usage the allocated
  CPU-seconds of ended attempts decayed with ``fairshare_half_life`` from ``tether_usage``,
  plus those of the attempts running now), ties by id (first come, first served): exactly a
  node's order.
- **EASY backfill across nodes.** The nodes the plan places jobs on are the up, undrained,
  non-login nodes whose heartbeat is on time (the caller always: it calls); each one's free
  resources are what its running jobs leave (for the caller, what its agent says it has
  free). In order, a job starts on the first node where it fits now (the caller first: a job
  that fits elsewhere only is left to that node, which claims it on its own pass, and its
  resources are counted as taken). The
  first job that fits nowhere now is *blocked* (``Resources``): from the announced ends of the
  running jobs (claim + time limit) and of those the plan starts, its reservation is the
  earliest moment enough frees on one node (the *shadow* time on the *reserved node*), with
  what will be left over there then (the *extra*). A later job may start now only if it fits
  and either runs on another node, or ends (by its own limit) by the shadow time, or fits in
  the extra (which it then takes). So the blocked job's start is never delayed. When no end is
  known (what it needs is held by jobs without a time limit), every node it could run on is
  kept for it: with one node that is a node's strict FIFO. Every other job waits ``Priority``.
- **Pending reasons.** Each examined job's reason (``Resources``, ``Priority``, ``Dependency``,
  ``BeginTime``, ``JobArrayTaskLimit``) is written to ``tether_jobs.pending_reason`` when it
  changed (``show`` and ``list`` read it; ``JobHeldUser`` comes from ``held`` itself).
- **Dependencies** (``tether_deps``): a node's kinds and rules (``agent/schedule.py``
  ``dependency_state``): ``[kind, id]`` names one job, ``[kind, -id]`` every element of array
  ``id`` together, ``["singleton", 0]`` the job's user and name.

Usage is charged when an attempt ends (``tether_charge``, from ``tether_report`` and
``tether_lose``): its CPUs times the time since its claim.
"""

from __future__ import annotations

#: Key of ``pg_advisory_xact_lock`` every claim takes: one plan at a time cluster-wide.
CLAIM_LOCK = 0x7465746865720002
#: Pending jobs one claim examines (held ones are not read), Slurm's bf_max_job_test.
WINDOW = 256
#: Default of ``fairshare_half_life`` (seconds): Slurm's PriorityDecayHalfLife, 7 days.
DEFAULT_HALF_LIFE = 7 * 86400.0

SCHED_FUNCTIONS = """
-- Each user's fair-share factor (agent/fairshare.py): users with usage or pending jobs have
-- equal shares; usage is ended attempts' CPU-seconds, decayed, plus the running ones' so far.
CREATE OR REPLACE FUNCTION tether_factors() RETURNS TABLE (f_uid integer, f_factor float8)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, {schema}, pg_temp AS $$
  WITH clock AS (
    SELECT extract(epoch FROM clock_timestamp())::float8 AS now,
           tether_setting('fairshare_half_life', '{half_life}')::float8 AS hl
  ), used AS (
    SELECT u.uid, u.cpu_seconds * CASE WHEN c.hl > 0 AND c.now > u.as_of
                                       THEN power(2::float8, -(c.now - u.as_of) / c.hl)
                                       ELSE 1 END AS v
      FROM tether_usage u, clock c
    UNION ALL
    SELECT j.uid, j.cpus_per_task::float8 * j.ntasks
           * greatest(0, extract(epoch FROM clock_timestamp() - a.claimed_at))::float8
      FROM tether_jobs j JOIN tether_attempts a ON a.job = j.id AND a.attempt = j.attempt
     WHERE j.state IN {active}
    UNION ALL
    SELECT DISTINCT j.uid, 0::float8 FROM tether_jobs j WHERE j.state = 'pending'
  ), per AS (
    SELECT uid, sum(greatest(v, 0)) AS v FROM used WHERE uid IS NOT NULL GROUP BY uid
  ), kept AS (  -- usage below a thousandth of a CPU-second is forgotten, as on a node
    SELECT uid, CASE WHEN v < 1e-3 THEN 0 ELSE v END AS v FROM per
  )
  SELECT k.uid, CASE WHEN t.total <= 0 THEN 1::float8
                     ELSE power(2::float8, -t.n * k.v / t.total) END
    FROM kept k, (SELECT count(*)::float8 AS n, sum(v) AS total FROM kept) t
$$;

-- An attempt ends: its CPUs times the time since its claim go to its user's usage (decayed
-- to now first). The caller holds the job's row; the attempt is still starting or running.
CREATE OR REPLACE FUNCTION tether_charge(p_job bigint, p_attempt integer) RETURNS void
    {definer} AS $$
DECLARE
  hl float8 := tether_setting('fairshare_half_life', '{half_life}')::float8;
  now_e float8 := extract(epoch FROM clock_timestamp());
  used float8; who integer;
BEGIN
  SELECT j.cpus_per_task::float8 * j.ntasks
         * greatest(0, extract(epoch FROM clock_timestamp() - a.claimed_at))::float8, j.uid
    INTO used, who
    FROM tether_jobs j JOIN tether_attempts a ON a.job = j.id AND a.attempt = p_attempt
   WHERE j.id = p_job AND a.state IN {active};
  IF used IS NULL OR used <= 0 OR who IS NULL THEN
    RETURN;
  END IF;
  INSERT INTO tether_usage AS u (uid, cpu_seconds, as_of) VALUES (who, used, now_e)
  ON CONFLICT (uid) DO UPDATE SET
    cpu_seconds = u.cpu_seconds * CASE WHEN hl > 0 AND now_e > u.as_of
                                       THEN power(2::float8, -(now_e - u.as_of) / hl) ELSE 1 END
                  + EXCLUDED.cpu_seconds,
    as_of = greatest(now_e, u.as_of);
END $$;

-- Where a job's dependencies stand (all must hold): 'satisfied', 'waiting' or why they never
-- will (agent/schedule.py dependency_state). [kind, id] names a job, [kind, -id] every element
-- of array id together, ["singleton", 0] the others of the job's user and name.
CREATE OR REPLACE FUNCTION tether_deps(j tether_jobs) RETURNS text {definer} AS $$
DECLARE
  d jsonb; kind text; ref bigint; what text; g record;
  result text := 'satisfied';
BEGIN
  FOR d IN SELECT * FROM jsonb_array_elements(j.dependency) LOOP
    IF jsonb_typeof(d) IS DISTINCT FROM 'array' OR jsonb_typeof(d->0) IS DISTINCT FROM 'string'
       OR jsonb_typeof(d->1) IS DISTINCT FROM 'number' THEN
      RETURN format('malformed dependency %s', left(d::text, 100));
    END IF;
    kind := d->>0;
    ref := trunc((d->>1)::numeric)::bigint;
    IF kind = 'singleton' THEN
      -- another job of its user and name runs, or waits ahead of it (a lower id)
      IF EXISTS (SELECT 1 FROM tether_jobs o WHERE o.uid = j.uid AND o.name = j.name
                 AND o.id <> j.id AND (o.state IN {active}
                                       OR (o.state = 'pending' AND o.id < j.id))) THEN
        result := 'waiting';
      END IF;
      CONTINUE;
    END IF;
    IF kind NOT IN ('afterok', 'afterany', 'afternotok', 'after', 'aftercorr') THEN
      RETURN format('unknown dependency kind %s', left(kind, 40));
    END IF;
    IF ref < 0 THEN
      what := format('%s:%s_*', kind, -ref);
      -- aftercorr: the element of the same index, or the whole array where there is none
      SELECT count(*) AS n, count(*) FILTER (WHERE e.state = 'completed') AS ok,
             count(*) FILTER (WHERE e.state IN {final}) AS ended,
             count(*) FILTER (WHERE e.state = 'pending') AS queued
        INTO g FROM tether_jobs e
       WHERE e.array_id = -ref
         AND (kind <> 'aftercorr' OR j.array_index IS NULL OR e.array_index = j.array_index
              OR NOT EXISTS (SELECT 1 FROM tether_jobs c WHERE c.array_id = -ref
                             AND c.array_index = j.array_index));
    ELSE
      what := format('%s:%s', kind, ref);
      SELECT count(*) AS n, count(*) FILTER (WHERE e.state = 'completed') AS ok,
             count(*) FILTER (WHERE e.state IN {final}) AS ended,
             count(*) FILTER (WHERE e.state = 'pending') AS queued
        INTO g FROM tether_jobs e WHERE e.id = ref;
    END IF;
    IF g.n = 0 THEN
      RETURN format('%s: no such job', what);
    END IF;
    IF kind IN ('afterok', 'aftercorr') THEN
      IF g.ended > g.ok THEN
        RETURN format('%s, which ended otherwise than completed', what);
      END IF;
      IF g.ok < g.n THEN result := 'waiting'; END IF;
    ELSIF kind = 'afternotok' THEN
      IF g.ok = g.n THEN
        RETURN format('%s, which completed', what);
      END IF;
      IF g.ended < g.n THEN result := 'waiting'; END IF;
    ELSIF kind = 'after' THEN
      IF g.queued > 0 THEN result := 'waiting'; END IF;
    ELSE  -- afterany
      IF g.ended < g.n THEN result := 'waiting'; END IF;
    END IF;
  END LOOP;
  RETURN result;
END $$;

-- Plan the cluster's queue (this module's docstring) and claim what the plan starts on the
-- calling node: each row as jsonb, with its env and the new attempt. A row that cannot run
-- anywhere (tether_invalid, or root's where root jobs are off) is failed with its reason and
-- passed over; a dependency that can never hold cancels its job.
CREATE OR REPLACE FUNCTION tether_claim(p_session text, p_cpus integer, p_gpus integer,
    p_memory_mb bigint) RETURNS SETOF jsonb {definer} AS $$
DECLARE
  me text := tether_me();
  nd record;
  j tether_jobs;
  bad text; deps text; why text;
  root_ok boolean := tether_setting('allow_root_jobs', 'false') = 'true';
  timeout float8 := tether_setting('heartbeat_timeout', '30')::float8;
  now_e float8;
  -- the nodes jobs may be placed on: name, free now, size
  n_name text[]; n_c bigint[]; n_g bigint[]; n_m bigint[];
  t_c bigint[]; t_g bigint[]; t_m bigint[];
  -- what the plan starts (claimed here, or left to the node it fits): node, end, holds, array
  s_node text[] := '{{}}'; s_end float8[] := '{{}}'; s_c bigint[] := '{{}}';
  s_g bigint[] := '{{}}'; s_m bigint[] := '{{}}'; s_group bigint[] := '{{}}';
  -- the blocked job: its needs, its reservation (shadow time, node, extra) or none known
  b_job bigint; b_c bigint; b_g bigint; b_m bigint;
  shadow float8; r_node text; x_c bigint; x_g bigint; x_m bigint;
  -- each examined job's reason
  why_job bigint[] := '{{}}'; why_text text[] := '{{}}';
  need bigint; job_end float8; att integer; i integer; spot integer; fits_any boolean;
  ok boolean;
BEGIN
  SELECT state, drain, session, login INTO nd FROM tether_nodes WHERE name = me FOR SHARE;
  IF nd.state <> 'up' OR nd.session <> p_session THEN
    RAISE EXCEPTION 'node % is not up in the cluster (or was registered by another agent)', me
      USING ERRCODE = 'TT503';
  END IF;
  PERFORM pg_advisory_xact_lock({claim_lock});  -- one plan at a time (see above)
  now_e := extract(epoch FROM clock_timestamp());
  SELECT array_agg(x.name ORDER BY x.name <> me, x.name), array_agg(x.fc ORDER BY x.name <> me,
         x.name), array_agg(x.fg ORDER BY x.name <> me, x.name),
         array_agg(x.fm ORDER BY x.name <> me, x.name), array_agg(x.cpus ORDER BY x.name <> me,
         x.name), array_agg(x.gpus ORDER BY x.name <> me, x.name),
         array_agg(x.memory_mb ORDER BY x.name <> me, x.name)
    INTO n_name, n_c, n_g, n_m, t_c, t_g, t_m
    FROM (SELECT n.name, n.cpus::bigint AS cpus, n.gpus::bigint AS gpus, n.memory_mb,
                 CASE WHEN n.name = me THEN p_cpus::bigint ELSE n.cpus
                      - coalesce(sum(a.cpus_per_task::bigint * a.ntasks), 0) END AS fc,
                 CASE WHEN n.name = me THEN p_gpus::bigint ELSE n.gpus
                      - coalesce(sum(a.gpus_req), 0) END AS fg,
                 CASE WHEN n.name = me THEN p_memory_mb ELSE n.memory_mb
                      - coalesce(sum(a.memory_mb), 0) END AS fm
            FROM tether_nodes n
            LEFT JOIN tether_jobs a ON a.node = n.name AND a.state IN {active}
           WHERE n.state = 'up' AND NOT n.drain AND NOT n.login AND n.cpus > 0
             AND (n.name = me  -- the caller is alive: it calls
                  OR n.heartbeat > clock_timestamp() - make_interval(secs => timeout))
           GROUP BY n.name) x;
  n_name := coalesce(n_name, '{{}}');
  FOR j IN SELECT t.* FROM tether_jobs t LEFT JOIN tether_factors() f ON f.f_uid = t.uid
            WHERE t.state IN {claim_from} AND NOT t.held
            ORDER BY coalesce(f.f_factor, 1) DESC, t.id
            LIMIT {window} FOR UPDATE OF t SKIP LOCKED LOOP
    bad := tether_invalid(j);
    IF bad IS NULL AND j.uid = 0 AND NOT root_ok THEN
      bad := 'root jobs are disabled in this cluster (tether cluster init --root-jobs allow)';
    END IF;
    IF bad IS NOT NULL THEN
      UPDATE tether_jobs SET state = {invalid_to}, reason = 'cannot run: ' || bad,
             ended_at = tether_now_text() WHERE id = j.id;
      PERFORM pg_notify('tether_job', j.id::text);
      CONTINUE;
    END IF;
    why := NULL;
    IF jsonb_array_length(j.dependency) > 0 THEN
      deps := tether_deps(j);
      IF deps = 'waiting' THEN
        why := 'Dependency';
      ELSIF deps <> 'satisfied' THEN
        UPDATE tether_jobs SET state = {never_to}, reason = 'DependencyNeverSatisfied: '
               || deps, ended_at = tether_now_text() WHERE id = j.id;
        PERFORM pg_notify('tether_job', j.id::text);
        PERFORM pg_notify('tether_queue', '');
        CONTINUE;
      END IF;
    END IF;
    IF why IS NULL AND j.begin_at IS NOT NULL AND j.begin_at > now_e THEN
      why := 'BeginTime';
    END IF;
    IF why IS NULL AND j.array_max IS NOT NULL AND
       (SELECT count(*) FROM tether_jobs WHERE array_id = j.array_id AND state IN {active})
       + (SELECT count(*) FROM unnest(s_group, s_node) AS s(grp, node)
           WHERE s.grp = j.array_id AND s.node <> me) >= j.array_max THEN
      why := 'JobArrayTaskLimit';  -- (this claim's own are 'starting' already: counted above)
    END IF;
    IF why IS NOT NULL THEN  -- it may not start whatever the resources: it blocks nobody
      why_job := why_job || j.id; why_text := why_text || why;
      CONTINUE;
    END IF;
    need := j.cpus_per_task::bigint * j.ntasks;
    job_end := CASE WHEN j.time_limit IS NULL THEN NULL ELSE now_e + j.time_limit END;
    spot := NULL; fits_any := false;
    FOR i IN 1 .. coalesce(array_length(n_name, 1), 0) LOOP
      CONTINUE WHEN need > t_c[i] OR j.gpus_req > t_g[i] OR j.memory_mb > t_m[i];
      fits_any := true;
      CONTINUE WHEN need > n_c[i] OR j.gpus_req > n_g[i] OR j.memory_mb > n_m[i];
      IF b_job IS NULL THEN
        ok := true;
      ELSIF r_node IS NULL THEN  -- no end known: every node the blocked job could run on
        ok := b_c > t_c[i] OR b_g > t_g[i] OR b_m > t_m[i];
      ELSIF n_name[i] <> r_node THEN
        ok := true;
      ELSIF job_end IS NOT NULL AND job_end <= shadow THEN
        ok := true;  -- it ends by the shadow time
      ELSIF need <= x_c AND j.gpus_req <= x_g AND j.memory_mb <= x_m THEN
        ok := true;  -- it still runs then, within what the blocked job leaves over
        x_c := x_c - need; x_g := x_g - j.gpus_req; x_m := x_m - j.memory_mb;
      ELSE
        ok := false;
      END IF;
      IF ok THEN
        spot := i;
        EXIT;
      END IF;
    END LOOP;
    IF spot IS NULL THEN
      IF fits_any AND b_job IS NULL THEN
        -- the blocked job: the earliest moment enough frees on one node, by the announced
        -- ends of what runs there and of what this plan starts
        b_job := j.id; b_c := need; b_g := j.gpus_req; b_m := j.memory_mb;
        SELECT e.node, greatest(e.t, now_e), f.c + e.c - need, f.g + e.g - j.gpus_req,
               f.m + e.m - j.memory_mb
          INTO r_node, shadow, x_c, x_g, x_m
          FROM (SELECT x.node, x.t, sum(x.c) OVER w AS c, sum(x.g) OVER w AS g,
                       sum(x.m) OVER w AS m
                  FROM (SELECT r.node, extract(epoch FROM coalesce(a.claimed_at,
                               clock_timestamp()))::float8 + r.time_limit AS t,
                               r.cpus_per_task::bigint * r.ntasks AS c, r.gpus_req::bigint AS g,
                               r.memory_mb AS m
                          FROM tether_jobs r
                          LEFT JOIN tether_attempts a ON a.job = r.id AND a.attempt = r.attempt
                         WHERE r.state IN {active} AND r.node = ANY(n_name)
                           AND r.time_limit IS NOT NULL
                        UNION ALL
                        SELECT s.node, s.t, s.c, s.g, s.m
                          FROM unnest(s_node, s_end, s_c, s_g, s_m) AS s(node, t, c, g, m)
                         WHERE s.t IS NOT NULL) x
                WINDOW w AS (PARTITION BY x.node ORDER BY x.t)) e
          JOIN unnest(n_name, n_c, n_g, n_m, t_c, t_g, t_m) AS f(node, c, g, m, tc, tg, tm)
            ON f.node = e.node
         WHERE need <= f.tc AND j.gpus_req <= f.tg AND j.memory_mb <= f.tm
           AND f.c + e.c >= need AND f.g + e.g >= j.gpus_req AND f.m + e.m >= j.memory_mb
         ORDER BY greatest(e.t, now_e), e.node LIMIT 1;
        why := 'Resources';
      ELSIF NOT fits_any THEN
        why := 'Resources';  -- no node that takes work now is big enough: it blocks nobody
      ELSE
        why := 'Priority';
      END IF;
      why_job := why_job || j.id; why_text := why_text || why;
      CONTINUE;
    END IF;
    n_c[spot] := n_c[spot] - need; n_g[spot] := n_g[spot] - j.gpus_req;
    n_m[spot] := n_m[spot] - j.memory_mb;
    s_node := s_node || n_name[spot]; s_end := s_end || job_end; s_c := s_c || need;
    s_g := s_g || j.gpus_req::bigint; s_m := s_m || j.memory_mb; s_group := s_group || j.array_id;
    IF n_name[spot] <> me THEN  -- it fits there: that node claims it on its own pass
      why_job := why_job || j.id; why_text := why_text || 'Resources'::text;
      CONTINUE;
    END IF;
    att := j.attempt + 1;
    UPDATE tether_jobs SET state = {claim_to}, attempt = att, node = me, local_job = NULL,
           reason = NULL, pending_reason = NULL, cpus = '[]', gpus = '[]', pids = '[]',
           supervisor_pid = NULL, started_at = NULL WHERE id = j.id;
    INSERT INTO tether_attempts (job, attempt, node, state) VALUES (j.id, att, me, 'starting');
    RETURN NEXT to_jsonb(j) || jsonb_build_object('attempt', att);
  END LOOP;
  UPDATE tether_jobs t SET pending_reason = w.txt
    FROM unnest(why_job, why_text) AS w(id, txt)
   WHERE t.id = w.id AND t.pending_reason IS DISTINCT FROM w.txt;
END $$;
"""
