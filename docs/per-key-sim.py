"""What a keyed delivery costs `mongod` in the current design and in per-key-design.md's.

A simulation, not the host: it replays the writes and reads one keyed delivery is made of,
in batches of 64 as the host sends them, over 1,000 keys x 20 events with the host's indexes,
and prints `mongod`'s CPU per delivery beside the bench's floor (read 100 documents, delete
them with one delete), measured on the same fresh `mongod`:

- current: a delivery document per keyed delivery (inserted parked behind its predecessor,
  unparked, read by the claim, deleted at completion), the event marked and stamped;
- owed on events: the design's first stage, waiting deliveries owed on their events (`owed`),
  each key's next one given its document, read by (key, sequence + 1), when its turn comes;
- design, lookup: the event is the record (marked `owed` with its lane), each completed key's
  next event found by a `$documents` + `$lookup` per key (the lowest owed sequence);
- design, point: the same, the next event read as (key, sequence + 1), in one `find`;
- the same with one lane document written per batch instead of 0.55 per delivery (what lane
  lists kept in fewer documents would cost).

All but the last write the lane lists the same way (one majority command per batch, 0.55 lane
documents per delivery, as the keyed drain measures). Run it from the repository's root:

    PYTHONPATH=$(scripts/ensure-python-deps.sh) python3 docs/per-key-sim.py $(scripts/ensure-mongod.sh)
"""

import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time

from bson import ObjectId
from pymongo import ASCENDING as A
from pymongo import MongoClient, UpdateOne, WriteConcern

KEYS, PER_KEY, BATCH = 1000, 20, 64
EVENTS = KEYS * PER_KEY
LANE_WRITES_PER_DELIVERY = 0.55
NOW = datetime.datetime.now(datetime.timezone.utc)


def start_mongod(binary):
    data = tempfile.mkdtemp(prefix="per-key-sim-")
    port = 27600 + os.getpid() % 300
    process = subprocess.Popen(
        [binary, "--dbpath", data, "--port", str(port), "--replSet", "rs0", "--bind_ip", "127.0.0.1", "--quiet"],
        stdout=subprocess.DEVNULL,
    )
    client = MongoClient(f"mongodb://127.0.0.1:{port}/?directConnection=true", serverSelectionTimeoutMS=30000)
    client.admin.command("replSetInitiate")
    while not client.admin.command("hello").get("isWritablePrimary"):
        time.sleep(0.2)
    return process, data, client


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def key_number(event):
    return int(event["key"].split("-")[1])


def events(db, owed_index):
    collection = db.events
    collection.drop()
    collection.create_index([("createdAt", A), ("_id", A)], name="unfanned", partialFilterExpression={"fannedOutAt": None})
    collection.create_index(
        [("key", A), ("sequence", A)], name="key_unfanned", partialFilterExpression={"fannedOutAt": None, "key": {"$exists": True}}
    )
    collection.create_index([("createdAt", A), ("_id", A)], name="created")
    if owed_index:
        collection.create_index([("key", A), ("sequence", A)], name="owed", partialFilterExpression={"owed.0": {"$exists": True}})
    docs = [
        {"_id": f"e-{s}-{k}", "type": "t", "key": f"key-{k}", "sequence": s + 1, "createdAt": NOW, "payload": {"n": s * KEYS + k}}
        for s in range(PER_KEY)
        for k in range(KEYS)
    ]
    for start in range(0, EVENTS, 1000):
        collection.insert_many(docs[start : start + 1000])
    return collection, docs


def lanes(db):
    collection = db.lanes
    collection.drop()
    collection.insert_many([{"_id": i, "epoch": 1, "owner": "h", "inFlight": []} for i in range(256)])
    return collection.with_options(write_concern=WriteConcern("majority"))


def write_lane_lists(lane_collection, lane_ids, entries, per_delivery=LANE_WRITES_PER_DELIVERY):
    count = max(1, int(len(entries) * per_delivery))
    lane_collection.bulk_write(
        [UpdateOne({"_id": lane, "epoch": 1}, {"$set": {"inFlight": entries[:4]}}) for lane in sorted(set(lane_ids))[:count]]
    )


def delivery_collection(db, parking):
    """The deliveries with the host's indexes (and the parking ones if `parking`)."""
    deliveries = db.deliveries
    deliveries.drop()
    deliveries.create_index([("eventId", A), ("handler", A)], name="event_handler", unique=True)
    deliveries.create_index(
        [("laneId", A), ("dueAt", A), ("_id", A), ("handler", A)], name="claim", partialFilterExpression={"lane": "ready"}
    )
    deliveries.create_index(
        [("handler", A), ("key", A), ("sequence", A)],
        name="ordering",
        partialFilterExpression={"status": "pending", "key": {"$exists": True}},
    )
    if parking:
        deliveries.create_index(
            [("lane", A), ("handler", A), ("key", A), ("sequence", A)], name="parked", partialFilterExpression={"lane": "parked"}
        )
        deliveries.create_index(
            [("behind", A)], name="parked_behind", partialFilterExpression={"lane": "parked", "behind": {"$exists": True}}
        )
    return deliveries, deliveries.with_options(write_concern=WriteConcern("majority"))


def delivery_of(event):
    return {
        "_id": ObjectId(), "eventId": event["_id"], "eventType": "t", "handler": "h", "key": event["key"],
        "sequence": event["sequence"], "laneId": key_number(event) % 256, "dueAt": NOW, "status": "pending",
        "claims": 0, "attempts": 0, "createdAt": NOW, "lane": "ready",
    }


def drain_documents(deliveries, lane_collection, event_collection, update, after):
    """Claims the ready deliveries batch by batch until none is left: lists them, reads their
    events, stamps them (`update`), deletes them, then `after(part)` readies the next."""
    while True:
        ready = list(deliveries.find({"lane": "ready", "laneId": {"$in": list(range(256))}}).hint("claim"))
        if not ready:
            break
        for first in range(0, len(ready), BATCH):
            part = ready[first : first + BATCH]
            ids = [d["_id"] for d in part]
            write_lane_lists(lane_collection, [d["laneId"] for d in part], [{"d": i, "c": 0, "h": "h"} for i in ids])
            event_ids = [d["eventId"] for d in part]
            list(event_collection.find({"_id": {"$in": event_ids}}))
            event_collection.update_many({"_id": {"$in": event_ids}}, update)
            deliveries.with_options(write_concern=WriteConcern("majority")).delete_many({"_id": {"$in": ids}})
            after(part)
    assert deliveries.count_documents({}) == 0


def current(db, pid):
    event_collection, docs = events(db, owed_index=False)
    lane_collection = lanes(db)
    deliveries, durable = delivery_collection(db, parking=True)
    start = cpu_seconds(pid)
    last_of_key = {}
    for first in range(0, EVENTS, BATCH):
        batch = docs[first : first + BATCH]
        event_collection.update_many({"_id": {"$in": [d["_id"] for d in batch]}}, {"$set": {"fannedOutAt": NOW, "handlers": ["h"]}})
        created = []
        for event in batch:
            delivery = delivery_of(event)
            if event["key"] in last_of_key:
                delivery["lane"], delivery["behind"] = "parked", last_of_key[event["key"]]
            last_of_key[event["key"]] = delivery["_id"]
            created.append(delivery)
        deliveries.insert_many(created)
    fanned_out = cpu_seconds(pid)

    def unpark(part):
        ids = [d["_id"] for d in part]
        followers = list(deliveries.find({"behind": {"$in": ids}, "lane": "parked"}, {"_id": 1}).hint("parked_behind"))
        if followers:
            durable.update_many(
                {"_id": {"$in": [f["_id"] for f in followers]}, "lane": "parked"},
                {"$set": {"lane": "ready"}, "$unset": {"behind": ""}},
            )

    drain_documents(deliveries, lane_collection, event_collection, {"$max": {"completedAt": NOW}}, unpark)
    return fanned_out - start, cpu_seconds(pid) - fanned_out


def owed_documents(db, pid):
    """Waiting deliveries owed on their events, a document only from their key's turn on."""
    event_collection, docs = events(db, owed_index=True)
    lane_collection = lanes(db)
    deliveries, durable = delivery_collection(db, parking=False)
    start = cpu_seconds(pid)
    seen = set()
    for first in range(0, EVENTS, BATCH):
        batch = docs[first : first + BATCH]
        event_collection.update_many(
            {"_id": {"$in": [d["_id"] for d in batch]}}, {"$set": {"fannedOutAt": NOW, "handlers": ["h"], "owed": ["h"]}}
        )
        heads = [delivery_of(event) for event in batch if event["key"] not in seen]
        seen.update(event["key"] for event in batch)
        if heads:
            deliveries.insert_many(heads)
    fanned_out = cpu_seconds(pid)

    def give_turns(part):
        following = list(next_by_point(db, event_collection, part))
        if following:
            durable.insert_many([delivery_of(event) for event in following])

    drain_documents(deliveries, lane_collection, event_collection, {"$pull": {"owed": "h"}, "$max": {"completedAt": NOW}}, give_turns)
    return fanned_out - start, cpu_seconds(pid) - fanned_out


def next_by_lookup(db, event_collection, part):
    return db.aggregate([
        {"$documents": [{"k": d["key"]} for d in part]},
        {"$lookup": {
            "from": event_collection.name, "localField": "k", "foreignField": "key", "as": "e",
            "pipeline": [{"$match": {"owed.0": {"$exists": True}, "owed": "h"}}, {"$sort": {"sequence": 1}}, {"$limit": 1}],
        }},
        {"$unwind": "$e"},
        {"$replaceWith": "$e"},
    ])


def next_by_point(db, event_collection, part):
    by_sequence = {}
    for event in part:
        by_sequence.setdefault(event["sequence"] + 1, []).append(event["key"])
    branches = [{"key": {"$in": keys}, "sequence": s, "owed.0": {"$exists": True}} for s, keys in by_sequence.items()]
    return event_collection.find({"$or": branches})


def design(db, pid, next_events, lane_writes_per_delivery=LANE_WRITES_PER_DELIVERY):
    event_collection, docs = events(db, owed_index=True)
    lane_collection = lanes(db)
    start = cpu_seconds(pid)
    for first in range(0, EVENTS, BATCH):
        batch = docs[first : first + BATCH]
        by_lane = {}
        for event in batch:
            by_lane.setdefault(key_number(event) % 256, []).append(event["_id"])
        lane = {"$switch": {"branches": [{"case": {"$in": ["$_id", ids]}, "then": n} for n, ids in by_lane.items()], "default": -1}}
        event_collection.update_many(
            {"_id": {"$in": [d["_id"] for d in batch]}},
            [{"$set": {"fannedOutAt": NOW, "handlers": ["h"], "owed": ["h"], "lane": lane}}],
        )
    fanned_out = cpu_seconds(pid)
    running = list(event_collection.find({"owed.0": {"$exists": True}, "sequence": 1}))
    while running:
        handed_out = []
        for first in range(0, len(running), BATCH):
            part = running[first : first + BATCH]
            ids = [d["_id"] for d in part]
            write_lane_lists(lane_collection, [d["lane"] for d in part], [{"e": i, "h": "h"} for i in ids], lane_writes_per_delivery)
            event_collection.update_many({"_id": {"$in": ids}}, {"$pull": {"owed": "h"}, "$max": {"completedAt": NOW}})
            handed_out += list(next_events(db, event_collection, part))
        running = handed_out
    assert event_collection.count_documents({"owed.0": {"$exists": True}}) == 0
    return fanned_out - start, cpu_seconds(pid) - fanned_out


def floor(db, pid):
    queue = db.queue
    queue.drop()
    queue.insert_many([{"n": i, "p": {"x": i}} for i in range(EVENTS)])
    start = cpu_seconds(pid)
    while ids := [d["_id"] for d in queue.find({}).limit(100)]:
        queue.delete_many({"_id": {"$in": ids}})
    return cpu_seconds(pid) - start


def main():
    process, data, client = start_mongod(sys.argv[1])
    try:
        db, pid = client.sim, process.pid
        per = lambda seconds: seconds * 1e6 / EVENTS
        for run in (1, 2):
            floor_us = per(floor(db, pid))
            print(f"run {run}: floor {floor_us:.0f} µs of mongod per document")
            for name, measure in [
                ("current", lambda: current(db, pid)),
                ("owed on events, a document from the key's turn", lambda: owed_documents(db, pid)),
                ("design, lookup", lambda: design(db, pid, next_by_lookup)),
                ("design, point", lambda: design(db, pid, next_by_point)),
                ("design, point, one lane document per batch", lambda: design(db, pid, next_by_point, 0.0)),
            ]:
                fan_out, drain = measure()
                total = per(fan_out + drain)
                print(
                    f"  {name:48} fan-out {per(fan_out):4.0f} + drain {per(drain):4.0f} = {total:4.0f} µs per delivery"
                    f" = {total / floor_us:.1f} floor documents",
                    flush=True,
                )
    finally:
        process.terminate()
        process.wait()
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
