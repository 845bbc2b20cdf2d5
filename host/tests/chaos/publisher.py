"""The chaos test's publisher: several threads commit orders with their events through the
README's `publish` (examples/publishers/python/publish.py), keyed and unkeyed, with some
transactions aborted on purpose, until the stop file appears. It rides out kills of the primary
and step-downs: a transaction that fails for good is simply not counted (the truth is what the
database holds at the end). Its own clock is skewed per thread, as publishers' clocks are."""
import datetime
import os
import random
import sys
import threading
import time

from pymongo import MongoClient
from pymongo.errors import PyMongoError

import publish as readme

uri, database, stop_file, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
KEYS = 12


clock = threading.local()


class Skewed:
    """`datetime.datetime` as each thread sees it: its clock runs `clock.skew` seconds off."""

    @staticmethod
    def now(tz=None):
        return datetime.datetime.now(tz) + datetime.timedelta(seconds=getattr(clock, "skew", 0.0))


def run(worker):
    client = MongoClient(uri, serverSelectionTimeoutMS=30000)
    db = client[database]
    rng = random.Random(worker)
    clock.skew = rng.uniform(-2.0, 2.0)
    n = 0
    while not os.path.exists(stop_file):
        n += 1
        order_id = "w%d-%d" % (worker, n)
        keyed = n % 2 == 0
        abort = rng.random() < 0.1

        def work(session):
            db.orders.insert_one({"_id": order_id}, session=session)
            readme.publish(db, session, "order.placed", {"orderId": order_id},
                           key=("customer-%d" % rng.randrange(KEYS)) if keyed else None,
                           event_id="order-placed-" + order_id)
            if abort:
                raise RuntimeError("declined")

        try:
            with client.start_session() as session:
                session.with_transaction(work)
        except RuntimeError:
            pass
        except PyMongoError as error:
            print("worker %d: %s" % (worker, error), file=sys.stderr, flush=True)
            time.sleep(0.2)
        time.sleep(rng.uniform(0.005, 0.03))


# Each thread's clock is off by up to two seconds either way.
workers = []
for worker in range(threads):
    thread = threading.Thread(target=run, args=(worker,))
    workers.append(thread)
readme.datetime = type("datetime_module", (), {"datetime": Skewed, "timezone": datetime.timezone})
for thread in workers:
    thread.start()
for thread in workers:
    thread.join()
