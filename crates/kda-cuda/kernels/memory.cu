// Memory movement and the stream-status plumbing: strided copy and fill on raw element bits,
// and the one-thread kernels that carry a stream's failure across events and host functions.

// Element-wise copy between two views of one dtype (`elsize` bytes per element), by bits.
extern "C" __global__ void kda_copy(const Status* status, View src, View dst, i64 n, int elsize) {
    if (stream_failed(status)) return;
    for (i64 i = global_thread(); i < n; i += grid_threads()) {
        i64 s = offset_of(src, i), d = offset_of(dst, i);
        switch (elsize) {
            case 1: ((u8*)dst.ptr)[d] = ((const u8*)src.ptr)[s]; break;
            case 2: ((u16*)dst.ptr)[d] = ((const u16*)src.ptr)[s]; break;
            default: ((u32*)dst.ptr)[d] = ((const u32*)src.ptr)[s]; break;
        }
    }
}

// Set every element of `dst` to the bit pattern `bits` (the host rounds the value).
extern "C" __global__ void kda_fill(const Status* status, View dst, i64 n, int elsize, u32 bits) {
    if (stream_failed(status)) return;
    for (i64 i = global_thread(); i < n; i += grid_threads()) {
        i64 d = offset_of(dst, i);
        switch (elsize) {
            case 1: ((u8*)dst.ptr)[d] = (u8)bits; break;
            case 2: ((u16*)dst.ptr)[d] = (u16)bits; break;
            default: ((u32*)dst.ptr)[d] = bits; break;
        }
    }
}

// At a record: keep the recording stream's failure id in the event's snapshot slot.
extern "C" __global__ void kda_status_snapshot(const Status* status, u32* slot) {
    *((volatile u32*)slot) = *((volatile const u32*)&status->fid);
}

// At a wait: a healthy waiting stream inherits the failure the event's snapshot carries.
extern "C" __global__ void kda_status_inherit(Status* status, const u32* slot) {
    u32 upstream = *((volatile const u32*)slot);
    if (upstream != 0 && !stream_failed(status)) {
        status->code = 0;
        *((volatile u32*)&status->fid) = upstream;
    }
}

// At a graph fork's first wait: the fork starts each launch with the origin's failure id
// (clearing whatever an earlier launch left there; nothing else ever clears a fork's record).
extern "C" __global__ void kda_status_reset(Status* status, const u32* slot) {
    status->code = 0;
    *((volatile u32*)&status->fid) = *((volatile const u32*)slot);
}

// Before a host function: tell the host (through mapped pinned memory) whether to skip it.
extern "C" __global__ void kda_status_publish(const Status* status, u32* mailbox) {
    *((volatile u32*)mailbox) = *((volatile const u32*)&status->fid);
    __threadfence_system();
}

// After a host function: take over the failure it reported, if any.
extern "C" __global__ void kda_status_absorb(Status* status, const u32* mailbox) {
    u32 fid = *((volatile const u32*)mailbox);
    if (fid != 0 && !stream_failed(status)) {
        status->code = 0;
        *((volatile u32*)&status->fid) = fid;
    }
}

// Element-wise conversion between float views of any dtypes (widen exactly, round once).
extern "C" __global__ void kda_convert(const Status* status, View src, View dst, i64 n) {
    if (stream_failed(status)) return;
    for (i64 i = global_thread(); i < n; i += grid_threads()) {
        st(dst, offset_of(dst, i), ld(src, offset_of(src, i)));
    }
}

// Nanoseconds since an arbitrary origin, the same on every SM (PTX's %globaltimer).
__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The failure code of a host function the stream stopped waiting for (src/status.rs).
#define CODE_HOST_TIMEOUT 5

// Hold the stream until the host has run the host function with this ticket (the stream's
// host worker writes `ticket`, or a later one, into the mapped flag). Host functions run on
// kda's own per-stream threads, not in driver callbacks, so one that blocks never holds up
// another stream's (the driver may run all callbacks on one thread). A function that has not
// finished after `limit_ns` fails the stream with `fid` (the host function's failure id) and
// the limit in milliseconds, and the wait ends: a host function that never returns must not
// hold the device, and every later synchronisation of the context, forever.
extern "C" __global__ void kda_host_wait(Status* status, const u32* flag, u32 ticket, u32 fid,
                                         i64 limit_ns) {
    u64 start = global_ns();
    while ((int)(*((volatile const u32*)flag) - ticket) < 0) {
        i64 waited = (i64)(global_ns() - start);
        if (waited > limit_ns) {
            i64 ms = limit_ns / 1000000;
            fail(status, fid, CODE_HOST_TIMEOUT, ms > 2147483647 ? 2147483647 : (int)ms, 0, 0, 0,
                 0, 0);
            return;
        }
        __nanosleep(2000);
    }
}
