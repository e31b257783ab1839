<?php
// The Redis client contract, run by tests/test_redis_clients.py with phpredis.
// Usage: php contract.php PORT QUEUE UNIQUE_QUEUE FROM_MEMCACHED TO_MEMCACHED
// Prints one JSON object per line: {"step": ..., "value": ...}.
[$_, $port, $q, $u, $fromMc, $toMc] = $argv;
$r = new Redis();
$r->connect("127.0.0.1", (int)$port, 5);
function out($step, $value) { echo json_encode(["step" => $step, "value" => $value]), "\n"; }
function nil($v) { return $v === false ? null : $v; }

foreach (["m1", "m2", "m3"] as $m) $r->lPush($q, $m);
out("fifo_lpush_rpop", [$r->rPop($q), $r->rPop($q), $r->rPop($q), nil($r->rPop($q))]);
foreach (["m1", "m2", "m3"] as $m) $r->rPush($q, $m);
out("fifo_rpush_lpop", [$r->lPop($q), $r->lPop($q), $r->lPop($q), nil($r->lPop($q))]);

$start = microtime(true);
$got = $r->brPop([$q], 1);
out("brpop_timeout", [empty($got) ? null : $got, round(microtime(true) - $start, 1)]);
out("waiting", null);
$got = $r->brPop([$q], 10);
out("brpop_woken", $got);

out("sadd", $r->sAdd($u, "a", "b", "a"));
out("scard", $r->sCard($u));
out("sismember", [$r->sIsMember($u, "a"), $r->sIsMember($u, "z")]);
out("srem", $r->sRem($u, "a"));
out("spop", [$r->sPop($u), nil($r->sPop($u)), $r->sCard($u)]);

out("from_memcached", nil($r->rPop($fromMc)));
out("to_memcached", $r->lPush($toMc, "from redis"));
