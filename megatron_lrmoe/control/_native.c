/* Compiled twins of the per-call controller's hot loops (plain C99, no dependencies).
 *
 * Built on first use by megatron_lrmoe/control/native.py and called through ctypes. Every
 * routine mirrors a Python routine of the same name, move for move, so plans are bit-identical
 * to the Python path (tests/test_control_native.py compares them):
 *
 *   placement.py   _RankOrder, _greedy, _best_fit, place_replicas (the threshold search)
 *   controller.py  _Holders.of_moves, _Call.place (the [E, P] forward matrices), _Call.start,
 *                  _Call.backward, _Call.caps_cut; plan_call's column sums and quotas_np
 *   balance.py     HolderGraph (components, _bound, _rebalance with its push, min_max,
 *                  caps_cut), _level
 *
 * The functions the controller calls per plan take one packed block of arguments (see the end
 * of the file); the others take plain arguments (tests, the placement API).
 *
 * Shapes: P ranks, E experts, L = E / P experts per rank (rank r owns [r*L, (r+1)*L)), M
 * replicated experts ("items"), K holder entries (item i owns entries bounds[i]..bounds[i+1]).
 * Everything is int64 and caller-allocated; scratch memory is malloc'ed per call.
 *
 * Python's integers are unbounded; here loads, pairs and byte counts must stay below 2**62 and
 * Q * A products (starting split) below 2**63, as numpy's int64 arrays already require.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

typedef int64_t i64;

/* The edge room of an entry without an edge cap (balance._NO_EDGE_CAP). */
#define NO_EDGE_CAP ((i64)1 << 62)
/* Return codes. */
#define LRMOE_OK 0
#define LRMOE_NONE 1      /* Python's None: infeasible / greedy failed */
#define LRMOE_NOMEM (-1)  /* malloc failed */
#define LRMOE_ASSERT (-2) /* an internal invariant of the Python code failed */

/* Python's a // b for b > 0. */
static i64 floor_div(i64 a, i64 b) {
    i64 q = a / b;
    if ((a % b != 0) && (a < 0)) q -= 1;
    return q;
}

/* Python's -(-a // b) for b > 0. */
static i64 ceil_div(i64 a, i64 b) { return -floor_div(-a, b); }

static i64 max_i64(i64 a, i64 b) { return a > b ? a : b; }
static i64 min_i64(i64 a, i64 b) { return a < b ? a : b; }

/* Ascending sort of n int64 keys in place: Shell sort with Ciura's gaps (then x 2.25). A few
 * dozen keys per call, where qsort's indirect comparisons cost more than the sort itself. */
static void sort_i64(i64 *a, i64 n) {
    static const i64 ciura[] = {1, 4, 10, 23, 57, 132, 301, 701};
    i64 gaps[64], count = 0;
    for (int j = 0; j < 8 && ciura[j] < n; j++) gaps[count++] = ciura[j];
    while (count && count < 64 && gaps[count - 1] * 9 / 4 < n) {
        gaps[count] = gaps[count - 1] * 9 / 4;
        count++;
    }
    while (count--) {
        i64 gap = gaps[count];
        for (i64 i = gap; i < n; i++) {
            i64 key = a[i], j = i;
            for (; j >= gap && a[j - gap] > key; j -= gap) a[j] = a[j - gap];
            a[j] = key;
        }
    }
}

/* Lower bound: first index in sorted a[0..n) with a[i] >= key (bisect.bisect_left). */
static i64 bisect_left(const i64 *a, i64 n, i64 key) {
    i64 lo = 0, hi = n;
    while (lo < hi) {
        i64 mid = lo + (hi - lo) / 2;
        if (a[mid] < key) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* ========================================================================================== */
/* Placement (placement.py)                                                                    */
/* ========================================================================================== */

/* _RankOrder: ranks by load both ways, ties to the lower rank, built once per search. Keys are
 * load * 2**bits + rank (ascending) and -load * 2**bits + rank (descending), distinct, so any
 * sort gives the same order. */
typedef struct {
    i64 num_ranks, total, bits;
    i64 *ascending_key;  /* [P] sorted */
    i64 *descending_key; /* [P] sorted */
    i64 *descending;     /* [P] ranks in descending_key's order */
} RankOrder;

static int rank_order_init(RankOrder *o, const i64 *rank_load, i64 num_ranks) {
    i64 bits = 0, span = num_ranks - 1 > 1 ? num_ranks - 1 : 1;
    while (span >> bits) bits++; /* int.bit_length() */
    o->num_ranks = num_ranks;
    o->bits = bits;
    o->total = 0;
    o->ascending_key = malloc(sizeof(i64) * (size_t)(3 * num_ranks + 1));
    if (!o->ascending_key) return LRMOE_NOMEM;
    o->descending_key = o->ascending_key + num_ranks;
    o->descending = o->descending_key + num_ranks;
    for (i64 g = 0; g < num_ranks; g++) {
        o->total += rank_load[g];
        o->ascending_key[g] = rank_load[g] * ((i64)1 << bits) + g;
        o->descending_key[g] = -rank_load[g] * ((i64)1 << bits) + g;
    }
    sort_i64(o->ascending_key, num_ranks);
    sort_i64(o->descending_key, num_ranks);
    for (i64 j = 0; j < num_ranks; j++)
        o->descending[j] = o->descending_key[j] & (((i64)1 << bits) - 1);
    return LRMOE_OK;
}

static void rank_order_free(RankOrder *o) { free(o->ascending_key); }

/* Binary min-heap of distinct keys (heapq): pops come out in key order. */
static void heap_push(i64 *heap, i64 *size, i64 key) {
    i64 j = (*size)++;
    while (j > 0) {
        i64 parent = (j - 1) / 2;
        if (heap[parent] <= key) break;
        heap[j] = heap[parent];
        j = parent;
    }
    heap[j] = key;
}

static i64 heap_pop(i64 *heap, i64 *size) {
    i64 top = heap[0], last = heap[--(*size)], j = 0, n = *size;
    for (;;) {
        i64 child = 2 * j + 1;
        if (child >= n) break;
        if (child + 1 < n && heap[child + 1] < heap[child]) child++;
        if (heap[child] >= last) break;
        heap[j] = heap[child];
        j = child;
    }
    if (n > 0) heap[j] = last;
    return top;
}

/* How many ranks are above T: the first of descending_key below -T * 2**bits. */
#define OVER_COUNT(o, T) \
    bisect_left((o)->descending_key, (o)->num_ranks, -(T) * ((i64)1 << (o)->bits))

/* _greedy: most-slack-first moves off the ranks above T. Writes (expert, rank, pairs) triples
 * to moves; returns the number of moves, or -1 for None. free_ and scratch hold >= P each. */
static i64 greedy(const i64 *expert_load, const i64 *rank_load, const i64 *hot_first, i64 local,
                  i64 T, const i64 *slots, const RankOrder *o, i64 *free_, i64 *heap,
                  i64 *used, i64 *moves) {
    i64 P = o->num_ranks, bits = o->bits, mask = ((i64)1 << bits) - 1;
    i64 num_over = OVER_COUNT(o, T);
    if (!num_over) return 0;
    int any_zero = 0;
    for (i64 g = 0; g < P; g++) {
        free_[g] = slots[g];
        any_zero |= slots[g] == 0;
    }
    i64 under = bisect_left(o->ascending_key, P, T * ((i64)1 << bits));
    /* Slack on ranks with a free slot minus the pairs still to move (see _greedy). */
    i64 margin = P * T - o->total, size = 0;
    for (i64 j = 0; j < under; j++) { /* ascending keys: already a heap */
        i64 key = o->ascending_key[j];
        if (!any_zero || free_[key & mask]) heap[size++] = key;
        else margin -= T - (key >> bits); /* stranded: no slot to use it */
    }
    if (margin < 0) return -1;
    i64 count = 0;
    for (i64 j = 0; j < num_over; j++) {
        i64 r = o->descending[j], need = rank_load[r] - T;
        for (i64 m = 0; m < local; m++) {
            i64 e = hot_first[r * local + m], left = expert_load[e], num_used = 0;
            while (left && size) {
                i64 key = heap_pop(heap, &size), g = key & mask, room = T - (key >> bits);
                i64 amount = need < left ? need : left;
                if (room < amount) amount = room;
                moves[3 * count] = e;
                moves[3 * count + 1] = g;
                moves[3 * count + 2] = amount;
                count++;
                free_[g] -= 1;
                need -= amount;
                left -= amount;
                if (!free_[g]) {
                    margin -= room - amount;
                    if (margin < 0) return -1;
                } else if (room > amount) {
                    used[num_used++] = key + amount * ((i64)1 << bits); /* back after e */
                }
                if (!need) break;
            }
            for (i64 u = 0; u < num_used; u++) heap_push(heap, &size, used[u]);
            if (!need) break;
            if (!size) return -1;
        }
        if (need) return -1;
    }
    return count;
}

/* _best_fit: each move to the rank with the least slack that takes all it could carry, else
 * the most slack. avail is a sorted array of slack * 2**bits + rank; same returns as greedy. */
static i64 best_fit(const i64 *expert_load, const i64 *rank_load, const i64 *hot_first,
                    i64 local, i64 T, const i64 *slots, const RankOrder *o, i64 *free_,
                    i64 *avail, i64 *used, i64 *moves) {
    i64 P = o->num_ranks, bits = o->bits, mask = ((i64)1 << bits) - 1, one = (i64)1 << bits;
    i64 num_over = OVER_COUNT(o, T);
    if (!num_over) return 0;
    int any_zero = 0;
    for (i64 g = 0; g < P; g++) {
        free_[g] = slots[g];
        any_zero |= slots[g] == 0;
    }
    i64 shift = T * one;
    i64 first = bisect_left(o->descending_key, P, (1 - T) * one); /* load < T */
    i64 margin = P * T - o->total, n = 0;
    for (i64 j = first; j < P; j++) {
        i64 key = shift + o->descending_key[j];
        if (!any_zero || free_[key & mask]) avail[n++] = key;
        else margin -= key >> bits; /* stranded: no slot to use it */
    }
    if (margin < 0) return -1;
    i64 count = 0;
    for (i64 j = 0; j < num_over; j++) {
        i64 r = o->descending[j], need = rank_load[r] - T;
        for (i64 m = 0; m < local; m++) {
            i64 e = hot_first[r * local + m], left = expert_load[e], num_used = 0;
            while (left && n) {
                i64 want = need < left ? need : left;
                i64 i = bisect_left(avail, n, want * one); /* least slack >= want */
                if (i == n) i = bisect_left(avail, n, (avail[n - 1] >> bits) * one); /* most */
                i64 key = avail[i];
                memmove(avail + i, avail + i + 1, sizeof(i64) * (size_t)(n - i - 1));
                n--;
                i64 g = key & mask, room = key >> bits;
                i64 amount = want < room ? want : room;
                moves[3 * count] = e;
                moves[3 * count + 1] = g;
                moves[3 * count + 2] = amount;
                count++;
                free_[g] -= 1;
                need -= amount;
                left -= amount;
                if (!free_[g]) {
                    margin -= room - amount;
                    if (margin < 0) return -1;
                } else if (room > amount) {
                    used[num_used++] = key - amount * one; /* eligible again after e */
                }
                if (!need) break;
            }
            for (i64 u = 0; u < num_used; u++) { /* bisect.insort: keys are distinct */
                i64 at = bisect_left(avail, n, used[u]);
                memmove(avail + at + 1, avail + at, sizeof(i64) * (size_t)(n - at));
                avail[at] = used[u];
                n++;
            }
            if (!need) break;
            if (!n) return -1;
        }
        if (need) return -1;
    }
    return count;
}

/* threshold_greedy / best_fit_greedy: one run with the rank orders built here (tests, and the
 * Python API). hot_first is [P, L]; moves holds 3 * (max moves) int64. Returns the count or -1. */
i64 lrmoe_greedy(i64 num_ranks, i64 local, const i64 *expert_load, const i64 *rank_load,
                 const i64 *hot_first, i64 threshold, const i64 *slots, int use_best_fit,
                 i64 *moves) {
    RankOrder o;
    if (rank_order_init(&o, rank_load, num_ranks)) return -2;
    i64 *scratch = malloc(sizeof(i64) * (size_t)(3 * num_ranks + 1));
    i64 *used = malloc(sizeof(i64) * (size_t)(num_ranks + 1));
    i64 result = -2;
    if (scratch && used) {
        i64 *free_ = scratch, *work = scratch + num_ranks;
        result = use_best_fit ? best_fit(expert_load, rank_load, hot_first, local, threshold,
                                         slots, &o, free_, work, used, moves)
                              : greedy(expert_load, rank_load, hot_first, local, threshold,
                                       slots, &o, free_, work, used, moves);
    }
    free(scratch);
    free(used);
    rank_order_free(&o);
    return result;
}

/* Replica slots per rank at threshold T (placement._slots_at): limit on every rank when room
 * is NULL, fixed room[g] when linear == 0, else the controller's memory-budget rule
 * min(max((room[g] - per_pair * T) // replica_bytes, 0), limit). */
typedef struct {
    const i64 *room;
    i64 per_pair, replica_bytes, limit;
    int linear;
} Slots;

/* Writes the slots at T; returns whether any is non-zero. */
static int slots_at(const Slots *s, i64 T, i64 num_ranks, i64 *out) {
    int any = 0;
    for (i64 g = 0; g < num_ranks; g++) {
        i64 v = s->room ? s->room[g] : s->limit;
        if (s->room && s->linear)
            v = min_i64(max_i64(floor_div(v - s->per_pair * T, s->replica_bytes), 0), s->limit);
        out[g] = v;
        any |= v != 0;
    }
    return any;
}

/* Per-search state of place_replicas. */
typedef struct {
    i64 P, local;
    const i64 *load;
    i64 *rank_load, *hot_first, *room, *free_, *work, *used, *trial;
    RankOrder order;
    const Slots *slots;
    i64 runs;
} Search;

/* place_replicas's attempt(T): best fit first, the most-slack greedy where it fails. */
static i64 attempt(Search *s, i64 T) {
    s->runs++;
    if (!slots_at(s->slots, T, s->P, s->room)) return -1;
    i64 n = best_fit(s->load, s->rank_load, s->hot_first, s->local, T, s->room, &s->order,
                     s->free_, s->work, s->used, s->trial);
    if (n < 0) {
        s->runs++;
        n = greedy(s->load, s->rank_load, s->hot_first, s->local, T, s->room, &s->order,
                   s->free_, s->work, s->used, s->trial);
    }
    return n;
}

/* A rank's owned experts [first, first + local) hottest first, ties to the lower id (the
 * stable argsort of -load): an insertion sort, short rows and no global comparator state. */
static void hot_first_row(const i64 *load, i64 first, i64 local, i64 *out) {
    for (i64 m = 0; m < local; m++) {
        i64 e = first + m, j = m;
        while (j > 0 && load[out[j - 1]] < load[e]) {
            out[j] = out[j - 1];
            j--;
        }
        out[j] = e;
    }
}

/* place_replicas up to the local search: the threshold search over greedy runs. moves holds
 * 3 * max_moves int64, with max_moves >= the most moves one run can make (sum of slots, at most
 * E * (P - 1)). info[0..4] receives (threshold, moves, greedy runs, low, top): threshold is the
 * best T found (top with no moves), moves in the order the greedy made them.
 * Requires P >= 1 and E divisible by P. */
int lrmoe_place_search(i64 num_ranks, i64 num_experts, const i64 *expert_load,
                       const i64 *slot_room, i64 per_pair, i64 replica_bytes, i64 limit,
                       int linear, double tolerance, i64 max_moves, i64 *moves, i64 *info) {
    i64 P = num_ranks, local = num_experts / P;
    Slots slots = {slot_room, per_pair, replica_bytes, limit, linear};
    Search s;
    memset(&s, 0, sizeof(s));
    i64 *block = malloc(sizeof(i64) * (size_t)(7 * P + num_experts + 3 * max_moves + 1));
    if (!block) return LRMOE_NOMEM;
    s.P = P;
    s.local = local;
    s.load = expert_load;
    s.slots = &slots;
    s.rank_load = block;
    s.room = block + P;
    s.free_ = block + 2 * P;
    s.work = block + 3 * P;
    s.used = block + 4 * P;
    s.hot_first = block + 5 * P;
    s.trial = block + 5 * P + num_experts;
    i64 top = 0, total = 0, hottest = 0;
    for (i64 g = 0; g < P; g++) {
        i64 sum = 0;
        for (i64 m = 0; m < local; m++) sum += expert_load[g * local + m];
        s.rank_load[g] = sum;
        total += sum;
        top = g ? max_i64(top, sum) : sum;
    }
    for (i64 e = 0; e < num_experts; e++) hottest = max_i64(hottest, expert_load[e]);
    i64 low = max_i64(ceil_div(total, P), ceil_div(hottest, P));
    info[0] = top;
    info[1] = 0;
    info[2] = 0;
    info[3] = low;
    info[4] = top;
    if (P <= 1 || top <= low) {
        free(block);
        return LRMOE_OK;
    }
    for (i64 g = 0; g < P; g++)
        hot_first_row(expert_load, g * local, local, s.hot_first + g * local);
    if (rank_order_init(&s.order, s.rank_load, P)) {
        free(block);
        return LRMOE_NOMEM;
    }
    i64 best_t = top, best_n = 0, n;
    /* Moves of a successful trial are copied out at once (the next trial reuses trial). */
#define KEEP_BEST(T)                                                              \
    do {                                                                          \
        best_t = (T);                                                             \
        best_n = n;                                                               \
        memcpy(moves, s.trial, sizeof(i64) * (size_t)(3 * n));                    \
    } while (0)
    n = attempt(&s, low);
    if (n >= 0) {
        KEEP_BEST(low);
    } else {
        /* Gallop up from the lower bound, then bisect the last bracket. */
        i64 bad = low, step = max_i64(max_i64(1, (i64)(tolerance * (double)low)), low >> 10);
        for (;;) {
            i64 trial = bad + step;
            if (trial >= top) break;
            n = attempt(&s, trial);
            if (n >= 0) {
                KEEP_BEST(trial);
                break;
            }
            bad = trial;
            step *= 2;
        }
        while (best_t - bad > max_i64(1, (i64)(tolerance * (double)best_t))) {
            i64 trial = (bad + best_t) / 2;
            n = attempt(&s, trial);
            if (n < 0) bad = trial;
            else KEEP_BEST(trial);
        }
    }
#undef KEEP_BEST
    info[0] = best_t;
    info[1] = best_n;
    info[2] = s.runs;
    rank_order_free(&s.order);
    free(block);
    return LRMOE_OK;
}

static int cmp_move(const void *a, const void *b) {
    const i64 *x = a, *y = b;
    if (x[0] != y[0]) return (x[0] > y[0]) - (x[0] < y[0]);
    return (x[1] > y[1]) - (x[1] < y[1]);
}

/* controller._Holders.of_moves: moves sorted by (expert, rank) -> flat holder entries, each
 * replicated expert's owner entry (the pairs the moves left there) in rank order. Writes
 * expert/rank/forward [K] and bounds [M + 1]; returns K and sets *num_items = M. */
static i64 holders_of_moves(const i64 *moves, i64 count, const i64 *expert_load, i64 local,
                            i64 *expert, i64 *rank, i64 *forward, i64 *bounds, i64 *experts,
                            i64 *num_items) {
    i64 k = 0, m = 0, i = 0;
    bounds[0] = 0;
    while (i < count) {
        i64 e = moves[3 * i], owner = e / local, j = i, sent = 0;
        while (j < count && moves[3 * j] == e) sent += moves[3 * j++ + 2];
        i64 home = expert_load[e] - sent;
        int placed = 0;
        for (i64 t = i; t < j; t++) {
            if (!placed && moves[3 * t + 1] > owner) {
                expert[k] = e, rank[k] = owner, forward[k++] = home;
                placed = 1;
            }
            expert[k] = e, rank[k] = moves[3 * t + 1], forward[k++] = moves[3 * t + 2];
        }
        if (!placed) expert[k] = e, rank[k] = owner, forward[k++] = home;
        experts[m] = e;
        bounds[++m] = k;
        i = j;
    }
    *num_items = m;
    return k;
}

/* _Call.place on the native path: the placement search (when search != 0), the holders of its
 * moves and the forward matrices, in one call.
 *
 * Outputs (caller-allocated): info[0..4] = (threshold, K, M, forward peak, fixed-ownership
 * peak), the peaks being the maxima of forward_rank_load and fixed_rank_load (P >= 1);
 * expert/rank/forward/flat [K]
 * (flat = expert * P + rank), bounds [M + 1] and experts [M] (the replicated experts), with
 * room for 2 * max_moves entries;
 * forward_load [E * P] and holds [E * P] (uint8, numpy bool; both zeroed by the caller) as
 * _Call.place fills them; rigid
 * [E] (uint8: experts with one holder); forward_rank_load, replicas_per_rank, fixed_rank_load
 * [P]. */
static int place_call(i64 num_ranks, i64 num_experts, const i64 *w, int search,
                     const i64 *slot_room, i64 per_pair, i64 replica_bytes, i64 limit,
                     int linear, double tolerance, i64 max_moves, i64 *info, i64 *expert,
                     i64 *rank, i64 *forward, i64 *flat, i64 *bounds, i64 *experts,
                     i64 *forward_load,
                     uint8_t *holds, uint8_t *rigid, i64 *forward_rank_load,
                     i64 *replicas_per_rank, i64 *fixed_rank_load) {
    i64 P = num_ranks, E = num_experts, local = E / P, top = 0, count = 0, K = 0, M = 0;
    for (i64 g = 0; g < P; g++) {
        i64 sum = 0;
        for (i64 m = 0; m < local; m++) sum += w[g * local + m];
        fixed_rank_load[g] = sum;
        forward_rank_load[g] = sum;
        replicas_per_rank[g] = 0;
        top = g ? max_i64(top, sum) : sum;
    }
    i64 threshold = top;
    i64 *moves = NULL;
    if (search) {
        i64 found[5];
        moves = malloc(sizeof(i64) * (size_t)(3 * max_moves + 1));
        if (!moves) return LRMOE_NOMEM;
        int status = lrmoe_place_search(P, E, w, slot_room, per_pair, replica_bytes, limit,
                                        linear, tolerance, max_moves, moves, found);
        if (status) {
            free(moves);
            return status;
        }
        count = found[1];
        threshold = count ? found[0] : found[4]; /* Placement(top, (), runs) without moves */
        qsort(moves, (size_t)count, 3 * sizeof(i64), cmp_move);
        K = holders_of_moves(moves, count, w, local, expert, rank, forward, bounds, experts, &M);
        free(moves);
    } else {
        bounds[0] = 0;
    }
    /* forward_load and holds come zeroed (numpy's zeros: fresh pages cost nothing to clear). */
    for (i64 e = 0; e < E; e++) {
        forward_load[e * P + e / local] = w[e];
        holds[e * P + e / local] = 1;
        rigid[e] = 1;
    }
    for (i64 k = 0; k < K; k++) {
        i64 e = expert[k], g = rank[k], owner = e / local;
        flat[k] = e * P + g;
        forward_load[flat[k]] = forward[k];
        holds[flat[k]] = 1;
        if (rigid[e]) { /* the first entry of an item: its pairs leave the owner's sum */
            rigid[e] = 0;
            forward_rank_load[owner] -= w[e];
        }
        forward_rank_load[g] += forward[k];
        if (g != owner) replicas_per_rank[g] += 1;
    }
    info[0] = threshold;
    info[1] = K;
    info[2] = M;
    info[3] = forward_rank_load[0];
    info[4] = fixed_rank_load[0];
    for (i64 g = 1; g < P; g++) {
        info[3] = max_i64(info[3], forward_rank_load[g]);
        info[4] = max_i64(info[4], fixed_rank_load[g]);
    }
    return LRMOE_OK;
}

/* ========================================================================================== */
/* Exact min-max assignment on the holder graph (balance.py HolderGraph)                      */
/* ========================================================================================== */

typedef struct {
    i64 P, M, K;
    const i64 *rank, *bounds, *room; /* room NULL: no edge caps */
    i64 *item;                       /* [K] item of every entry */
    i64 *at_start, *at_list;         /* CSR: each rank's entries, ascending */
    i64 *comp_start, *comp_list;     /* components of the holder graph, BFS order */
    i64 num_comps;
    i64 *x, *load, *limit;
    i64 *rank_level, *item_level, *rank_arc, *item_arc, *queue, *over, *scratch;
    void *block;
} Graph;

static i64 room_of(const Graph *G, i64 k) { return G->room ? G->room[k] : NO_EDGE_CAP; }

/* HolderGraph.__init__: each entry's item, each rank's entries, the components. */
static int graph_init(Graph *G, i64 P, i64 M, const i64 *rank, const i64 *bounds,
                      const i64 *room, i64 *x, i64 *load) {
    i64 K = bounds[M];
    G->P = P, G->M = M, G->K = K, G->rank = rank, G->bounds = bounds, G->room = room;
    G->x = x, G->load = load;
    /* item, at_list [K]; at_start, comp_start [P + 1]; comp_list, limit, rank_level,
     * rank_arc, queue, over [P]; item_level, item_arc [M]; scratch [3P]. */
    size_t words = (size_t)(2 * K + 2 * (P + 1) + 6 * P + 2 * M + 3 * P + 1);
    i64 *b = malloc(sizeof(i64) * words);
    if (!b) return LRMOE_NOMEM;
    G->block = b;
    G->item = b, b += K;
    G->at_start = b, b += P + 1;
    G->at_list = b, b += K;
    G->comp_start = b, b += P + 1;
    G->comp_list = b, b += P;
    G->limit = b, b += P;
    G->rank_level = b, b += P;
    G->item_level = b, b += M;
    G->rank_arc = b, b += P;
    G->item_arc = b, b += M;
    G->queue = b, b += P;
    G->over = b, b += P;
    G->scratch = b;
    for (i64 i = 0; i < M; i++)
        for (i64 k = bounds[i]; k < bounds[i + 1]; k++) G->item[k] = i;
    memset(G->at_start, 0, sizeof(i64) * (size_t)(P + 1));
    for (i64 k = 0; k < K; k++) G->at_start[rank[k] + 1]++;
    for (i64 g = 0; g < P; g++) G->at_start[g + 1] += G->at_start[g];
    for (i64 g = 0; g < P; g++) G->rank_arc[g] = G->at_start[g]; /* fill cursor */
    for (i64 k = 0; k < K; k++) G->at_list[G->rank_arc[rank[k]]++] = k;
    /* Components (ranks linked by shared items) by breadth-first search, as __init__. */
    i64 *seen = G->item_level, *done = G->rank_level, n = 0;
    for (i64 i = 0; i < M; i++) seen[i] = 0;
    for (i64 g = 0; g < P; g++) done[g] = 0;
    G->num_comps = 0;
    for (i64 g = 0; g < P; g++) {
        if (done[g]) continue;
        done[g] = 1;
        G->comp_start[G->num_comps++] = n;
        i64 head = n;
        G->comp_list[n++] = g;
        for (; head < n; head++) {
            i64 u = G->comp_list[head];
            for (i64 a = G->at_start[u]; a < G->at_start[u + 1]; a++) {
                i64 i = G->item[G->at_list[a]];
                if (seen[i]) continue;
                seen[i] = 1;
                for (i64 kk = bounds[i]; kk < bounds[i + 1]; kk++) {
                    i64 h = rank[kk];
                    if (!done[h]) {
                        done[h] = 1;
                        G->comp_list[n++] = h;
                    }
                }
            }
        }
    }
    G->comp_start[G->num_comps] = n;
    return LRMOE_OK;
}

static void graph_free(Graph *G) { free(G->block); }

/* _level: smallest T with sum_g min(T, caps[g]) >= total over the n ranks in caps (has[g] == 0:
 * no cap). Returns 0 and sets *out, or LRMOE_NONE. sorted needs n entries of scratch. */
static int level(const i64 *caps, const uint8_t *has, i64 n, i64 total, i64 *sorted,
                 i64 *out) {
    i64 nb = 0, sum = 0;
    for (i64 g = 0; g < n; g++)
        if (!has || has[g]) sorted[nb++] = caps[g], sum += caps[g];
    sort_i64(sorted, nb);
    if (nb == n && sum < total) return LRMOE_NONE;
    i64 prefix = 0;
    /* T in (sorted[k-1], sorted[k]]: the k smallest caps are full, the rest hold T each. */
    for (i64 k = 0; k <= nb; k++) {
        i64 rest = n - k;
        if (rest > 0) {
            i64 lv = max_i64(ceil_div(total - prefix, rest), 0);
            if (k == nb || lv <= sorted[k]) {
                *out = max_i64(lv, k ? sorted[k - 1] : 0);
                return LRMOE_OK;
            }
        }
        if (k < nb) prefix += sorted[k];
    }
    return LRMOE_NONE;
}

/* HolderGraph._bound: the first probe's lower bound, per component. caps NULL: uncapped. */
static int bound(Graph *G, const i64 *caps, const uint8_t *has, int capped, i64 *out) {
    i64 result = 0, *sub_caps = G->scratch, *sorted = G->scratch + G->P;
    uint8_t *sub_has = (uint8_t *)G->over; /* scratch: P bytes */
    for (i64 c = 0; c < G->num_comps; c++) {
        i64 start = G->comp_start[c], size = G->comp_start[c + 1] - start, total = 0;
        const i64 *members = G->comp_list + start;
        if (size == 1) {
            i64 g = members[0];
            if (capped && (!has || has[g]) && G->load[g] > caps[g]) return LRMOE_NONE;
            result = max_i64(result, G->load[g]);
            continue;
        }
        for (i64 j = 0; j < size; j++) total += G->load[members[j]];
        if (!capped) {
            result = max_i64(result, ceil_div(total, size));
            continue;
        }
        for (i64 j = 0; j < size; j++) {
            sub_caps[j] = caps[members[j]];
            sub_has[j] = has ? has[members[j]] : 1;
        }
        i64 lv;
        if (level(sub_caps, sub_has, size, total, sorted, &lv)) return LRMOE_NONE;
        result = max_i64(result, lv);
    }
    *out = result;
    return LRMOE_OK;
}

/* The recursive push of HolderGraph._rebalance: up to amount from non-target rank g along the
 * level graph; returns what moved. Arcs resume where the last path left (rank_arc, item_arc). */
static i64 push(Graph *G, i64 g, i64 amount) {
    i64 *x = G->x, *load = G->load, *limit = G->limit;
    i64 item_next = G->rank_level[g] + 1, hold_next = item_next + 1;
    const i64 *arcs = G->at_list + G->at_start[g];
    i64 a = G->rank_arc[g], stop = G->at_start[g + 1] - G->at_start[g];
    while (a < stop) {
        i64 k = arcs[a], i = G->item[k], have = x[k];
        if (G->item_level[i] == item_next && have > 0) {
            i64 part = amount < have ? amount : have;
            i64 kk = G->item_arc[i], end = G->bounds[i + 1];
            while (kk < end) {
                i64 h = G->rank[kk];
                if (G->rank_level[h] == hold_next) {
                    i64 space = room_of(G, kk) - x[kk];
                    if (space > part) space = part;
                    if (space > 0) {
                        i64 moved;
                        if (load[h] < limit[h]) { /* a target */
                            moved = limit[h] - load[h];
                            if (moved > space) moved = space;
                            load[h] += moved;
                        } else {
                            moved = push(G, h, space);
                        }
                        if (moved) {
                            x[kk] += moved;
                            x[k] -= moved;
                            G->item_arc[i] = kk;
                            G->rank_arc[g] = a;
                            return moved;
                        }
                    }
                }
                kk++;
            }
            G->item_arc[i] = kk;
        }
        a++;
    }
    G->rank_arc[g] = a;
    return 0;
}

/* HolderGraph._rebalance: Dinic phases moving load from ranks over G->limit to ranks under it,
 * in place. Returns 0 on success, else the size of the cut written (ascending) to cut: the
 * ranks the last breadth-first search reached, none under its limit. */
static i64 rebalance(Graph *G, i64 *cut) {
    i64 P = G->P, M = G->M, *x = G->x, *load = G->load, *limit = G->limit, num_over = 0;
    for (i64 g = 0; g < P; g++)
        if (load[g] > limit[g]) G->over[num_over++] = g;
    while (num_over) {
        for (i64 g = 0; g < P; g++) G->rank_level[g] = -1;
        for (i64 i = 0; i < M; i++) G->item_level[i] = -1;
        i64 qlen = 0;
        for (i64 j = 0; j < num_over; j++) {
            G->rank_level[G->over[j]] = 0;
            G->queue[qlen++] = G->over[j];
        }
        int reached = 0;
        for (i64 qi = 0; qi < qlen; qi++) {
            i64 g = G->queue[qi], item_next = G->rank_level[g] + 1;
            for (i64 a = G->at_start[g]; a < G->at_start[g + 1]; a++) {
                i64 k = G->at_list[a], i = G->item[k];
                if (G->item_level[i] >= 0 || !x[k]) continue;
                G->item_level[i] = item_next;
                for (i64 kk = G->bounds[i]; kk < G->bounds[i + 1]; kk++) {
                    i64 h = G->rank[kk];
                    if (G->rank_level[h] >= 0 || x[kk] >= room_of(G, kk)) continue;
                    G->rank_level[h] = item_next + 1;
                    if (load[h] < limit[h]) reached = 1; /* a target: paths end here */
                    else G->queue[qlen++] = h;
                }
            }
        }
        if (!reached) { /* sorted(queue): every rank reached */
            i64 n = 0;
            for (i64 g = 0; g < P; g++)
                if (G->rank_level[g] >= 0) cut[n++] = g;
            return n;
        }
        for (i64 g = 0; g < P; g++) G->rank_arc[g] = 0;
        for (i64 i = 0; i < M; i++) G->item_arc[i] = G->bounds[i];
        /* push from each over rank (level 0) until within its limit or stuck, inlined as in
         * Python: the loop continues at the arc and holder where the last path left. */
        for (i64 j = 0; j < num_over; j++) {
            i64 g = G->over[j], amount = load[g] - limit[g];
            const i64 *arcs = G->at_list + G->at_start[g];
            i64 a = 0, stop = G->at_start[g + 1] - G->at_start[g];
            while (a < stop) {
                i64 k = arcs[a], i = G->item[k], have = x[k];
                if (G->item_level[i] == 1 && have > 0) {
                    i64 part = amount < have ? amount : have;
                    i64 kk = G->item_arc[i], end = G->bounds[i + 1], moved = 0;
                    while (kk < end) {
                        i64 h = G->rank[kk];
                        if (G->rank_level[h] == 2) {
                            i64 space = room_of(G, kk) - x[kk];
                            if (space > part) space = part;
                            if (space > 0) {
                                if (load[h] < limit[h]) { /* a target */
                                    moved = limit[h] - load[h];
                                    if (moved > space) moved = space;
                                    load[h] += moved;
                                } else {
                                    moved = push(G, h, space);
                                }
                                if (moved) {
                                    x[kk] += moved;
                                    x[k] -= moved;
                                    break;
                                }
                            }
                        }
                        kk++;
                    }
                    G->item_arc[i] = kk;
                    if (moved) {
                        load[g] -= moved;
                        amount -= moved;
                        if (!amount) break;
                        continue; /* the same arc again */
                    }
                }
                a++;
            }
        }
        i64 kept = 0;
        for (i64 j = 0; j < num_over; j++)
            if (load[G->over[j]] > limit[G->over[j]]) G->over[kept++] = G->over[j];
        num_over = kept;
    }
    return 0;
}

static i64 max_load(const Graph *G) {
    i64 top = G->load[0];
    for (i64 g = 1; g < G->P; g++) top = max_i64(top, G->load[g]);
    return top;
}

/* HolderGraph.min_max after the graph is built, x and load set from the start. caps NULL: no
 * caps; has NULL: every rank capped (else has[g] == 0 is Python's None). */
static int min_max_solve(Graph *G, const i64 *base, const i64 *caps, const uint8_t *has) {
    i64 P = G->P, *load = G->load;
    int capped = caps != NULL, any_cap = 0;
    if (capped)
        for (i64 g = 0; g < P; g++)
            if (!has || has[g]) {
                any_cap = 1;
                if (base[g] > caps[g]) return LRMOE_NONE;
            }
    if (P == 0) return LRMOE_OK;
    i64 *cut = G->scratch + 2 * P; /* scratch: 3P words */
    if (capped) {
        i64 top = max_load(G);
        for (i64 g = 0; g < P; g++) G->limit[g] = (!has || has[g]) ? caps[g] : top;
        if (rebalance(G, cut)) return LRMOE_NONE;
    }
    i64 low, high = 0;
    if (bound(G, caps, has, capped && any_cap, &low)) return LRMOE_NONE;
    high = max_load(G);
    while (low < high) {
        for (i64 g = 0; g < P; g++) {
            int has_cap = capped && (!has || has[g]);
            G->limit[g] = (!has_cap || low < caps[g]) ? low : caps[g];
        }
        i64 n = rebalance(G, cut);
        if (!n) {
            high = max_load(G);
            continue;
        }
        /* No pairs can leave the cut R: the optimum T* has sum_R min(T*, cap) >= load(R). */
        i64 total = 0, *sub_caps = G->scratch, *sorted = G->scratch + P, lv;
        uint8_t *sub_has = (uint8_t *)G->over;
        for (i64 j = 0; j < n; j++) {
            total += load[cut[j]];
            sub_caps[j] = capped ? caps[cut[j]] : 0;
            sub_has[j] = capped && (!has || has[cut[j]]);
        }
        if (level(sub_caps, sub_has, n, total, sorted, &lv) || lv <= low) return LRMOE_ASSERT;
        low = lv;
    }
    return LRMOE_OK;
}

/* HolderGraph.min_max: x holds the starting amount per entry on entry and the optimal
 * assignment on return; load receives the load per rank. Returns LRMOE_OK or LRMOE_NONE (the
 * rank capacities cannot be met). */
int lrmoe_min_max(i64 num_ranks, i64 num_items, const i64 *rank, const i64 *bounds,
                  const i64 *room, const i64 *base, i64 *x, const i64 *caps,
                  const uint8_t *has, i64 *load) {
    Graph G;
    for (i64 g = 0; g < num_ranks; g++) load[g] = base[g];
    for (i64 k = 0; k < bounds[num_items]; k++) load[rank[k]] += x[k];
    if (graph_init(&G, num_ranks, num_items, rank, bounds, room, x, load)) return LRMOE_NOMEM;
    int status = min_max_solve(&G, base, caps, has);
    graph_free(&G);
    return status;
}

/* HolderGraph.caps_cut: 0 when the caps admit an assignment, else the size of a violated cut
 * written to cut (ascending). x is the start (modified). */
i64 lrmoe_caps_cut(i64 num_ranks, i64 num_items, const i64 *rank, const i64 *bounds,
                   const i64 *room, const i64 *base, i64 *x, const i64 *caps, i64 *load,
                   i64 *cut) {
    for (i64 g = 0; g < num_ranks; g++)
        if (base[g] > caps[g]) {
            cut[0] = g;
            return 1;
        }
    Graph G;
    for (i64 g = 0; g < num_ranks; g++) load[g] = base[g];
    for (i64 k = 0; k < bounds[num_items]; k++) load[rank[k]] += x[k];
    if (graph_init(&G, num_ranks, num_items, rank, bounds, room, x, load)) return -1;
    for (i64 g = 0; g < num_ranks; g++) G.limit[g] = caps[g];
    i64 n = rebalance(&G, cut);
    graph_free(&G);
    return n;
}

/* ========================================================================================== */
/* The controller's backward assignment (controller.py _Call.start, _Call.backward)           */
/* ========================================================================================== */

/* _Call.start: the rigid load per rank (base [P]) and the replicated experts' starting split
 * (x [K]): each holder floor(Q A / max(W, 1)), then the units left one each to the item's
 * holders in rank order (save mode: only holders with forward pairs take one, B <= A). */
static void start_split(i64 P, i64 E, const i64 *quota, const i64 *w, const uint8_t *rigid,
                        i64 M, const i64 *expert, const i64 *forward, const i64 *bounds,
                        int save, i64 *base, i64 *x) {
    i64 local = E / P;
    for (i64 g = 0; g < P; g++) {
        i64 sum = 0;
        for (i64 m = 0; m < local; m++)
            if (rigid[g * local + m]) sum += quota[g * local + m];
        base[g] = sum;
    }
    for (i64 i = 0; i < M; i++) {
        i64 e = expert[bounds[i]], q = quota[e], divisor = max_i64(w[e], 1), left = q;
        for (i64 k = bounds[i]; k < bounds[i + 1]; k++) {
            x[k] = q * forward[k] / divisor;
            left -= x[k];
        }
        i64 position = 0;
        for (i64 k = bounds[i]; k < bounds[i + 1]; k++) {
            if (save && forward[k] <= 0) continue; /* controller._NEVER: takes no unit */
            if (position++ < left) x[k] += 1;
        }
    }
}

/* _Call.backward's assignment: the start, the exact min-max (rank caps if caps != NULL) and the
 * [E, P] backward load (zeroed by the caller; quota on the owner for rigid experts, the
 * assignment on the holders). rank_load [P + 2] receives the load per rank, then its maximum
 * (the backward peak) and the largest per-owner quota sum (fixed ownership's backward peak).
 * With no item and no caps every kept pair stays on its owner. Returns LRMOE_OK, LRMOE_NONE
 * (caps admit no assignment) or an error. */
static int backward(i64 num_ranks, i64 num_experts, const i64 *quota, const i64 *w,
                   const uint8_t *rigid, i64 num_items, const i64 *expert, const i64 *rank,
                   const i64 *forward, const i64 *flat, const i64 *bounds, int save,
                   const i64 *caps, i64 *backward_load, i64 *rank_load) {
    i64 P = num_ranks, E = num_experts, K = bounds[num_items], local = E / P;
    for (i64 e = 0; e < E; e++) backward_load[e * P + e / local] = quota[e];
    i64 *base = malloc(sizeof(i64) * (size_t)(P + K + 1));
    if (!base) return LRMOE_NOMEM;
    i64 *x = base + P;
    start_split(P, E, quota, w, rigid, num_items, expert, forward, bounds, save, base, x);
    int status = LRMOE_OK;
    if (!caps && !num_items) {
        memcpy(rank_load, base, sizeof(i64) * (size_t)P); /* per_owner(quota) */
    } else {
        status = lrmoe_min_max(P, num_items, rank, bounds, save ? forward : NULL, base, x, caps,
                               NULL, rank_load);
        if (status == LRMOE_OK)
            for (i64 k = 0; k < K; k++) backward_load[flat[k]] = x[k];
    }
    free(base);
    if (status != LRMOE_OK) return status;
    i64 peak = rank_load[0], owner_peak = 0;
    for (i64 g = 0; g < P; g++) {
        i64 sum = 0;
        for (i64 m = 0; m < local; m++) sum += quota[g * local + m];
        peak = max_i64(peak, rank_load[g]);
        owner_peak = g ? max_i64(owner_peak, sum) : sum;
    }
    rank_load[P] = peak;
    rank_load[P + 1] = owner_peak;
    return LRMOE_OK;
}

/* _Call.caps_cut: the start, then HolderGraph.caps_cut. Returns the cut's size (0: none). */
static i64 start_caps_cut(i64 num_ranks, i64 num_experts, const i64 *quota, const i64 *w,
                         const uint8_t *rigid, i64 num_items, const i64 *expert,
                         const i64 *rank, const i64 *forward, const i64 *bounds, int save,
                         const i64 *caps, i64 *cut) {
    i64 P = num_ranks, K = bounds[num_items];
    i64 *base = malloc(sizeof(i64) * (size_t)(2 * P + K + 1));
    if (!base) return -1;
    i64 *load = base + P, *x = base + 2 * P;
    start_split(P, num_experts, quota, w, rigid, num_items, expert, forward, bounds, save, base,
                x);
    i64 n = lrmoe_caps_cut(P, num_items, rank, bounds, save ? forward : NULL, base, x, caps,
                           load, cut);
    free(base);
    return n;
}

/* _Call.start alone (tests compare it with the numpy version). */
void lrmoe_start(i64 num_ranks, i64 num_experts, const i64 *quota, const i64 *w,
                 const uint8_t *rigid, i64 num_items, const i64 *expert, const i64 *forward,
                 const i64 *bounds, int save, i64 *base, i64 *x) {
    start_split(num_ranks, num_experts, quota, w, rigid, num_items, expert, forward, bounds,
                save, base, x);
}

/* ========================================================================================== */
/* plan_call's pass over the counts (controller.py plan_call, quota.py quotas_np)             */
/* ========================================================================================== */

/* W = the column sums of N [P, E] and the quotas Q0 = quotas_np(W, keep): keep >= 1 keeps W,
 * else min(max(ceil(W keep - (abs_tol + rel_tol W keep)), 0), W) in the same float64 steps as
 * numpy (the library is built with -ffp-contract=off: no fused multiply-add). Returns 1 when a
 * count is negative (plan_call's ValueError), else 0. */
static int counts(i64 num_ranks, i64 num_experts, const i64 *restrict n, double keep,
                 double abs_tol, double rel_tol, i64 *restrict w, i64 *restrict q0) {
    /* Row by row, so the loop vectorises (restrict: no aliasing); the sign bits are OR-ed:
     * some count is negative exactly when the OR of all of them is. */
    i64 bits = 0, r = 0;
    for (i64 e = 0; e < num_experts; e++) w[e] = 0;
    for (; r + 4 <= num_ranks; r += 4) { /* four rows per pass over w */
        const i64 *restrict a = n + r * num_experts, *restrict b = a + num_experts;
        const i64 *restrict c = b + num_experts, *restrict d = c + num_experts;
        for (i64 e = 0; e < num_experts; e++) {
            w[e] += (a[e] + b[e]) + (c[e] + d[e]);
            bits |= (a[e] | b[e]) | (c[e] | d[e]);
        }
    }
    for (; r < num_ranks; r++) {
        const i64 *restrict row = n + r * num_experts;
        for (i64 e = 0; e < num_experts; e++) {
            w[e] += row[e];
            bits |= row[e];
        }
    }
    int negative = bits < 0;
    for (i64 e = 0; e < num_experts; e++) {
        if (keep >= 1.0) {
            q0[e] = w[e];
            continue;
        }
        double ideal = (double)w[e] * keep;
        double tol = abs_tol + rel_tol * ideal;
        i64 quota = (i64)ceil(ideal - tol);
        q0[e] = min_i64(max_i64(quota, 0), w[e]);
    }
    return negative;
}

/* ========================================================================================== */
/* Packed entry points                                                                         */
/* ========================================================================================== */

/* ctypes converts every declared argument on its own (about 0.4 us each on the development
 * machine: 9 us for place_call's 23), so the per-call functions take one block of 8-byte fields
 * packed by struct (native.py), in the order of the parameters above: integers and addresses
 * as int64, the float parameters as double. memcpy: no alignment assumed. */
static i64 field(const char *block, int i) {
    i64 v;
    memcpy(&v, block + 8 * i, sizeof v);
    return v;
}

static double real(const char *block, int i) {
    double v;
    memcpy(&v, block + 8 * i, sizeof v);
    return v;
}

#define F(i) field(block, i)
#define PTR(type, i) ((type *)(intptr_t)field(block, i))

/* place_call's fields, then (when field 24, the quota, is not 0) backward's on the placement
 * just made, without caps: quota, save, backward_load, rank_load. That assignment of the
 * uncapped quotas is the first one every plan asks for (_Call.solve), so it rides along. */
int lrmoe_place_call(const char *block) {
    i64 *info = PTR(i64, 11);
    int status = place_call(F(0), F(1), PTR(const i64, 2), (int)F(3), PTR(const i64, 4), F(5),
                            F(6), F(7), (int)F(8), real(block, 9), F(10), info, PTR(i64, 12),
                            PTR(i64, 13), PTR(i64, 14), PTR(i64, 15), PTR(i64, 16),
                            PTR(i64, 17), PTR(i64, 18), PTR(uint8_t, 19), PTR(uint8_t, 20),
                            PTR(i64, 21), PTR(i64, 22), PTR(i64, 23));
    if (status != LRMOE_OK || !F(24)) return status;
    return backward(F(0), F(1), PTR(const i64, 24), PTR(const i64, 2), PTR(const uint8_t, 20),
                    info[2], PTR(const i64, 12), PTR(const i64, 13), PTR(const i64, 14),
                    PTR(const i64, 15), PTR(const i64, 16), (int)F(25), NULL, PTR(i64, 26),
                    PTR(i64, 27));
}

int lrmoe_place_search_packed(const char *block) {
    return lrmoe_place_search(F(0), F(1), PTR(const i64, 2), PTR(const i64, 3), F(4), F(5), F(6),
                              (int)F(7), real(block, 8), F(9), PTR(i64, 10), PTR(i64, 11));
}

int lrmoe_backward(const char *block) {
    return backward(F(0), F(1), PTR(const i64, 2), PTR(const i64, 3), PTR(const uint8_t, 4),
                    F(5), PTR(const i64, 6), PTR(const i64, 7), PTR(const i64, 8),
                    PTR(const i64, 9), PTR(const i64, 10), (int)F(11), PTR(const i64, 12),
                    PTR(i64, 13), PTR(i64, 14));
}

i64 lrmoe_start_caps_cut(const char *block) {
    return start_caps_cut(F(0), F(1), PTR(const i64, 2), PTR(const i64, 3),
                          PTR(const uint8_t, 4), F(5), PTR(const i64, 6), PTR(const i64, 7),
                          PTR(const i64, 8), PTR(const i64, 9), (int)F(10), PTR(const i64, 11),
                          PTR(i64, 12));
}

int lrmoe_counts(const char *block) {
    return counts(F(0), F(1), PTR(const i64, 2), real(block, 3), real(block, 4), real(block, 5),
                  PTR(i64, 6), PTR(i64, 7));
}

#undef F
#undef PTR
