"""Feature ``dspark-result-materializer``: DSpark decode results converted to host lists on one
background thread per scheduler (the copy stays enqueued on the scheduler thread right behind the
forward). See docs/dspark_results.md."""
