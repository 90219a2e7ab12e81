"""Before expert compute, integers only: pair counts (and budgets) in, a frozen call plan out.

``controller.plan_call`` is the entry point (quotas, replica placement, forward and backward
assignment, memory plan); ``costs``, ``quota``, ``placement``, ``balance``, ``assignment`` and
``budgets`` are its stages, ``plan`` holds the plan objects, ``native`` the compiled twins and
``reference`` the slow, obvious references the tests compare the stages' algorithms with.
"""
