"""Worker roles on a lab node and the scheduler resources that stand for them.

The lab node assigns these from the credential at admission; tasks are placed by them
(catalog work under verification: ``goblin-volunteer``; everything else: ``goblin-lab``).
"""

VOLUNTEER_RESOURCE = "goblin-volunteer"
LAB_RESOURCE = "goblin-lab"
#: The lab worker runs any number of glue tasks at once (its threads limit it).
LAB_SLOTS = 1_000_000
#: The name of the lab's trusted worker (its credential's and the scheduler's).
LAB_WORKER_NAME = "lab-worker"
