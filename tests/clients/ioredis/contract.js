// The Redis client contract, run by tests/test_redis_clients.py with ioredis.
// Usage: node contract.js PORT QUEUE UNIQUE_QUEUE FROM_MEMCACHED TO_MEMCACHED
// Prints one JSON object per line: {"step": ..., "value": ...}.
const Redis = require("ioredis");

async function main() {
  const [port, q, u, fromMc, toMc] = process.argv.slice(2);
  const r = new Redis({ host: "127.0.0.1", port: Number(port), maxRetriesPerRequest: 0 });
  const out = (step, value) => console.log(JSON.stringify({ step, value }));

  for (const m of ["m1", "m2", "m3"]) await r.lpush(q, m);
  out("fifo_lpush_rpop", [await r.rpop(q), await r.rpop(q), await r.rpop(q), await r.rpop(q)]);
  for (const m of ["m1", "m2", "m3"]) await r.rpush(q, m);
  out("fifo_rpush_lpop", [await r.lpop(q), await r.lpop(q), await r.lpop(q), await r.lpop(q)]);

  const start = Date.now();
  const got = await r.brpop(q, 1);
  out("brpop_timeout", [got, Math.round((Date.now() - start) / 100) / 10]);
  out("waiting", null);
  out("brpop_woken", await r.brpop(q, 10));

  out("sadd", await r.sadd(u, "a", "b", "a"));
  out("scard", await r.scard(u));
  out("sismember", [await r.sismember(u, "a"), await r.sismember(u, "z")]);
  out("srem", await r.srem(u, "a"));
  out("spop", [await r.spop(u), await r.spop(u), await r.scard(u)]);

  out("from_memcached", await r.rpop(fromMc));
  out("to_memcached", await r.lpush(toMc, "from redis"));
  r.disconnect();
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
